// HostDevice: pinned host memory (cuMemHostAlloc, cuMemFreeHost): page-rounded anonymous
// mappings, tracked so that copies can tell pinned memory from pageable memory.
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/host_device_books.hpp"

namespace vmalloc {

using detail::hex;
using detail::human_bytes;

void* HostDevice::host_alloc(std::size_t size) {
  count(DriverCall::host_alloc);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || size > max_request_bytes)
    fail(DriverCall::host_alloc,
         "size " + std::to_string(size) + " must be positive and at most 2**56 bytes",
         cu_result::invalid_value);
  const std::size_t rounded = (size + page_size_ - 1) / page_size_ * page_size_;
  // Counted even when unbacked: the pinned memory is real host memory in both modes.
  const bool was_backed_budget = backed_;
  if (was_backed_budget) reserve_vmas(1, DriverCall::host_alloc);
  // Unbacked devices never copy bytes, so their host memory need not be committed.
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (backed_ ? 0 : MAP_NORESERVE);
  void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (was_backed_budget) return_vmas(1);
    fail(DriverCall::host_alloc,
         "cannot allocate " + human_bytes(size) + " of host memory: " + std::strerror(err),
         cu_result::out_of_memory);
  }
  host_blocks_.emplace(reinterpret_cast<std::uintptr_t>(p), HostBlock{rounded});
  host_bytes_ += rounded;
  return p;
}

void HostDevice::host_free(void* ptr) {
  count(DriverCall::host_free);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto it = host_blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == host_blocks_.end())
    fail(DriverCall::host_free,
         hex(reinterpret_cast<std::uintptr_t>(ptr)) +
             " is not pinned host memory from host_alloc (or was already freed)",
         cu_result::invalid_value);
  ::munmap(ptr, it->second.size);
  if (backed_) return_vmas(1);
  host_bytes_ -= it->second.size;
  host_blocks_.erase(it);
}

bool HostDevice::host_range_pinned(std::uintptr_t ptr, std::size_t n) const {
  auto it = host_blocks_.upper_bound(ptr);
  if (it == host_blocks_.begin()) return false;
  --it;
  const std::uintptr_t end = it->first + it->second.size;
  return ptr < end && n <= end - ptr;
}

}  // namespace vmalloc
