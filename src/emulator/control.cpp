// The emulator's control functions (prefix vmallocEmulator), for tests: faults, call counts,
// the leak report, the last error message, device configuration, reset. C ABI, callable with
// ctypes (vmalloc.testing wraps them). They return a CUresult where they can fail and record
// the reason as the last error; they never throw.
#include <algorithm>
#include <cstring>

#include "emulator.hpp"
#include "vmalloc/base/errors.hpp"

#define VMALLOC_EMULATOR_EXPORT extern "C" __attribute__((visibility("default")))

using namespace vmalloc::driver;
using vmalloc::emulator::Emulator;
using vmalloc::emulator::EntryPoint;
using vmalloc::emulator::Failure;

extern "C" {
// Counts of what one emulated device holds (all fields unsigned 64-bit).
struct VmallocEmulatorDeviceState {
  unsigned long long capacity;
  unsigned long long granularity;
  unsigned long long primary_context_refs;
  unsigned long long handles;                // created and not released
  unsigned long long released_still_mapped;  // released, alive through a mapping
  unsigned long long bytes_created;          // of both kinds above
  unsigned long long reservations;
  unsigned long long bytes_reserved;
  unsigned long long mappings;
  unsigned long long bytes_mapped;
  unsigned long long host_allocations;
  unsigned long long host_bytes;
  unsigned long long streams;
  unsigned long long events;
};
}

namespace {

// Copies `text` into buffer[size] (NUL-terminated, truncated); returns text's full length.
std::size_t copy_out(const std::string& text, char* buffer, std::size_t size) noexcept {
  if (buffer != nullptr && size > 0) {
    const std::size_t n = std::min(size - 1, text.size());
    std::memcpy(buffer, text.data(), n);
    buffer[n] = '\0';
  }
  return text.size();
}

// Control calls are recorded under this name in the last error message.
template <class Body>
CUresult control(const char* name, Body&& body) noexcept {
  auto failed = [&](CUresult code, const std::string& message) noexcept {
    try {
      Emulator::instance().record_error(name, code, message);
    } catch (...) {
    }
    return code;
  };
  try {
    body(Emulator::instance());
    return CUDA_SUCCESS;
  } catch (const Failure& f) {
    return failed(f.code, f.message);
  } catch (const vmalloc::DeviceError& x) {
    return failed(x.code() ? x.code() : CUDA_ERROR_UNKNOWN, x.what());
  } catch (const vmalloc::Error& x) {
    return failed(CUDA_ERROR_INVALID_VALUE, x.what());
  } catch (const std::bad_alloc&) {
    return failed(CUDA_ERROR_OUT_OF_MEMORY, "the emulator ran out of host memory");
  } catch (const std::exception& x) {
    return failed(CUDA_ERROR_UNKNOWN, x.what());
  } catch (...) {
    return failed(CUDA_ERROR_UNKNOWN, "internal error");
  }
}

EntryPoint entry_point(const char* name) {
  EntryPoint entry{};
  if (name == nullptr || !vmalloc::emulator::find_entry_point(name, &entry))
    vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE,
                            std::string("'") + (name ? name : "(null)") +
                                "' is not an entry point of the emulator");
  return entry;
}

}  // namespace

// Arms a fault: calls nth .. nth+count-1 (counted from now; count 0 = no end) of
// `entry_point` return `result`.
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorSetFault(const char* entry_point_name,
                                                         unsigned long long nth, CUresult result,
                                                         unsigned long long count) {
  return control("vmallocEmulatorSetFault", [&](Emulator& e) {
    const EntryPoint entry = entry_point(entry_point_name);
    if (nth == 0) vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, "nth must be >= 1");
    if (result == CUDA_SUCCESS)
      vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, "result must be a failing CUresult");
    e.faults().arm(entry, nth, result, count, e.call_count(entry));
  });
}

// Arms the faults of a spec in VMALLOC_EMULATOR_FAIL's syntax ("cuMemMap:3:2,...").
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorSetFaults(const char* spec) {
  return control("vmallocEmulatorSetFaults", [&](Emulator& e) {
    if (spec == nullptr) vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, "spec is NULL");
    const std::string why = e.faults().arm_spec(spec, e.counts());
    if (!why.empty()) vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, why);
  });
}

VMALLOC_EMULATOR_EXPORT void vmallocEmulatorClearFaults(void) {
  control("vmallocEmulatorClearFaults", [](Emulator& e) { e.faults().clear(); });
}

// Calls of `entry_point` since load or reset (failed and injected ones included); 0 for an
// unknown name.
VMALLOC_EMULATOR_EXPORT unsigned long long vmallocEmulatorCallCount(const char* name) {
  vmalloc::emulator::EntryPoint entry{};
  if (name == nullptr || !vmalloc::emulator::find_entry_point(name, &entry)) return 0;
  try {
    return Emulator::instance().call_count(entry);
  } catch (...) {
    return 0;
  }
}

// The leak report of device `ordinal` (< 0: every device): one line per live resource, ""
// when nothing leaked. Writes at most size-1 characters plus NUL; returns the full length.
VMALLOC_EMULATOR_EXPORT std::size_t vmallocEmulatorLeakReport(int ordinal, char* buffer,
                                                              std::size_t size) {
  std::string report;
  control("vmallocEmulatorLeakReport",
          [&](Emulator& e) { report = e.leak_report(ordinal); });
  return copy_out(report, buffer, size);
}

// Why the calling thread's last failed call failed ("cuMemMap: CUDA_ERROR_INVALID_VALUE: ...").
VMALLOC_EMULATOR_EXPORT std::size_t vmallocEmulatorLastError(char* buffer, std::size_t size) {
  try {
    return copy_out(Emulator::last_error(), buffer, size);
  } catch (...) {
    return 0;
  }
}

// Back to the state after load: devices rebuilt from the environment, no handles, contexts,
// faults or counts; cuInit must be called again. Only while no CudaDevice is alive.
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorReset(void) {
  return control("vmallocEmulatorReset", [](Emulator& e) { e.reset(); });
}

// Number of emulated devices (no cuInit needed).
VMALLOC_EMULATOR_EXPORT int vmallocEmulatorDeviceCount(void) {
  try {
    return Emulator::instance().device_count();
  } catch (...) {
    return 0;
  }
}

// Adds a device (capacity, granularity: 0 = the configured default); returns its ordinal.
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorAddDevice(std::size_t capacity,
                                                          std::size_t granularity, int* ordinal) {
  return control("vmallocEmulatorAddDevice", [&](Emulator& e) {
    if (ordinal == nullptr) vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, "ordinal is NULL");
    *ordinal = e.add_device(capacity, granularity);
  });
}

// Replaces idle device `ordinal` by a fresh one with this capacity and granularity (0 = the
// configured default). CUDA_ERROR_NOT_PERMITTED while it is in use.
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorConfigureDevice(int ordinal,
                                                                std::size_t capacity,
                                                                std::size_t granularity) {
  return control("vmallocEmulatorConfigureDevice",
                 [&](Emulator& e) { e.configure_device(ordinal, capacity, granularity); });
}

VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorGetDeviceState(int ordinal,
                                                               VmallocEmulatorDeviceState* out) {
  return control("vmallocEmulatorGetDeviceState", [&](Emulator& e) {
    if (out == nullptr) vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, "state is NULL");
    const vmalloc::emulator::GpuState s = e.state(ordinal);
    *out = VmallocEmulatorDeviceState{s.capacity,        s.granularity,
                                      s.primary_context_refs, s.handles,
                                      s.released_still_mapped, s.bytes_created,
                                      s.reservations,    s.bytes_reserved,
                                      s.mappings,        s.bytes_mapped,
                                      s.host_allocations, s.host_bytes,
                                      s.streams,         s.events};
  });
}

// Prints every failure to stderr (as VMALLOC_EMULATOR_VERBOSE=1 does) when verbose != 0.
VMALLOC_EMULATOR_EXPORT void vmallocEmulatorSetVerbose(int verbose) {
  control("vmallocEmulatorSetVerbose", [&](Emulator& e) { e.set_verbose(verbose != 0); });
}

// Blocks `stream` (NULL: the calling thread's current context's default stream) like a kernel
// that runs until told to stop, until vmallocEmulatorReleaseHold(*ordinal, *hold). Work queued
// behind it, and on streams that must wait for it, then provably has not run: a test can show
// that code orders its streams with events (a non-blocking stream does not wait for stream 0).
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorHoldStream(CUstream stream, int* ordinal,
                                                           unsigned long long* hold) {
  return control("vmallocEmulatorHoldStream", [&](Emulator& e) {
    if (ordinal == nullptr || hold == nullptr)
      vmalloc::emulator::fail(CUDA_ERROR_INVALID_VALUE, "ordinal or hold is NULL");
    std::lock_guard<std::recursive_mutex> lock(e.mutex());
    const auto [gpu, host] = e.resolve_stream(stream);
    *hold = gpu->device->hold_stream(host);
    *ordinal = gpu->ordinal;
  });
}

// Lets the stream held by vmallocEmulatorHoldStream go on. CUDA_ERROR_INVALID_HANDLE for an
// unknown or already released hold.
VMALLOC_EMULATOR_EXPORT CUresult vmallocEmulatorReleaseHold(int ordinal, unsigned long long hold) {
  return control("vmallocEmulatorReleaseHold", [&](Emulator& e) {
    std::lock_guard<std::recursive_mutex> lock(e.mutex());
    e.gpu(ordinal).device->release_hold(hold);
  });
}
