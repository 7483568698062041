// Primary contexts and the per-thread context stack, as the driver keeps them: each device has
// one primary context, reference-counted by cuDevicePrimaryCtxRetain/Release; each thread has a
// stack of current contexts (cuCtxPushCurrent/PopCurrent; cuCtxSetCurrent replaces the top).
#include "contexts.hpp"

#include "emulator.hpp"

namespace vmalloc::emulator {

std::vector<CUcontext>& context_stack() {
  thread_local std::vector<CUcontext> stack;
  return stack;
}

void Emulator::retain_primary(CUcontext* context, CUdevice device) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  Gpu& g = gpu(device);
  ++g.primary_refs;
  *context = g.context;
}

void Emulator::release_primary(CUdevice device) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  Gpu& g = gpu(device);
  if (g.primary_refs == 0)
    fail(CUDA_ERROR_INVALID_CONTEXT, "the primary context of device " + std::to_string(device) +
                                         " is not retained (more releases than retains)");
  --g.primary_refs;
}

bool Emulator::known_context(CUcontext context) const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  for (const auto& g : gpus_)
    if (g->context == context) return true;
  return false;
}

Gpu& Emulator::current_gpu() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  const auto& stack = context_stack();
  if (stack.empty())
    fail(CUDA_ERROR_INVALID_CONTEXT,
         "no context is current on this thread: retain the primary context "
         "(cuDevicePrimaryCtxRetain) and make it current (cuCtxSetCurrent or cuCtxPushCurrent)");
  const CUcontext current = stack.back();
  for (const auto& g : gpus_) {
    if (g->context != current) continue;
    if (g->primary_refs == 0)
      fail(CUDA_ERROR_INVALID_CONTEXT,
           "the current context is the primary context of device " + std::to_string(g->ordinal) +
               ", which is not retained (cuDevicePrimaryCtxRelease dropped its last reference)");
    return *g;
  }
  fail(CUDA_ERROR_INVALID_CONTEXT,
       "the current context " + hex(reinterpret_cast<std::uintptr_t>(current)) +
           " is not a live context (its device was reset or reconfigured)");
}

}  // namespace vmalloc::emulator
