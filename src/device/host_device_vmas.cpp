// HostDevice: the process's budget of kernel VMAs. Every mmap'ed reservation, mapping piece
// and pinned host block is a VMA, and past vm.max_map_count the kernel refuses new ones with
// an ENOMEM that looks like running out of memory; counting them first turns that into a
// refusal naming the cause.
#include <atomic>
#include <fstream>
#include <string>

#include "vmalloc/device/host_device.hpp"

namespace vmalloc {

namespace {

// Kernel VMAs are a per-process budget (vm.max_map_count), so every HostDevice of the
// process draws from one counter. Headroom is left for the interpreter's own mappings.
constexpr std::size_t vma_headroom = 5530;
std::size_t initial_vma_limit() {
  std::size_t max_map_count = 65530;
  std::ifstream f("/proc/sys/vm/max_map_count");
  if (f) f >> max_map_count;
  return max_map_count > 2 * vma_headroom ? max_map_count - vma_headroom : max_map_count / 2;
}
std::atomic<std::size_t> vmas_held{0};
std::atomic<std::size_t> process_vma_limit{initial_vma_limit()};

}  // namespace

std::size_t HostDevice::vma_limit() noexcept { return process_vma_limit.load(); }
void HostDevice::set_vma_limit(std::size_t limit) noexcept { process_vma_limit.store(limit); }
std::size_t HostDevice::process_vmas() noexcept { return vmalloc::vmas_held.load(); }

void HostDevice::reserve_vmas(std::size_t more, DriverCall call) {
  if (!backed_ || more == 0) return;
  std::size_t current = vmas_held.load();
  for (;;) {
    const std::size_t limit = process_vma_limit.load();
    if (current + more <= limit) {
      if (vmas_held.compare_exchange_weak(current, current + more)) break;
      continue;  // `current` reloaded
    }
    // Checked mode's guards give way to the program's mappings, oldest first: they are a
    // check, and spending the budget on them failed allocations (host_device_guards.cpp).
    if (recycle_oldest_guard()) {
      current = vmas_held.load();
      continue;
    }
    fail(call,
         "the process would hold more than " + std::to_string(limit) +
             " memory mappings (vm.max_map_count minus headroom; " + std::to_string(current) +
             " held by emulated devices): use a larger granularity or fewer, larger chunks",
         cu_result::out_of_memory);
  }
  vmas_ += more;
}

// For checked mode opening pages of a new allocation: it must happen whatever the budget says
// (a live byte must not fault), and splits a guard run in two at most.
void HostDevice::reserve_vmas_unchecked(std::size_t more) noexcept {
  if (!backed_ || more == 0) return;
  vmas_held.fetch_add(more);
  vmas_ += more;
}

void HostDevice::return_vmas(std::size_t fewer) noexcept {
  if (!backed_ || fewer == 0) return;
  vmas_held.fetch_sub(fewer);
  vmas_ -= fewer;
}

}  // namespace vmalloc
