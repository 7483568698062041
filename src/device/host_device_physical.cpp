// HostDevice: physical memory (cuMemCreate, cuMemRelease), regions of the device's memfd.
#include <algorithm>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/host_device_books.hpp"
#include "vmalloc/device/detail/memfd_arena.hpp"

namespace vmalloc {

using detail::hex;
using detail::human_bytes;

physical_handle HostDevice::create(std::size_t size) {
  count(DriverCall::create);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || size % granularity_ != 0)
    fail(DriverCall::create,
         "size " + std::to_string(size) + " is not a positive multiple of the granularity " +
             std::to_string(granularity_),
         cu_result::invalid_value);
  if (size > max_request_bytes)
    fail(DriverCall::create,
         "size " + std::to_string(size) + " is larger than vmalloc's limit of 2**56 bytes",
         cu_result::invalid_value);
  if (capacity_ != 0 && size > capacity_ - std::min(capacity_, bytes_created_))
    throw OutOfMemory("cuMemCreate on " + name() + ": cannot create " + human_bytes(size) +
                          ": " + human_bytes(bytes_created_) + " of the capacity " +
                          human_bytes(capacity_) + " are in use",
                      size, state_line_locked());
  const std::uint64_t offset = backed_ ? arena_->allocate(size) : 0;
  const physical_handle handle = next_handle_++;
  physical_.emplace(handle, Physical{size, offset, 0, false});
  bytes_created_ += size;
  return handle;
}

void HostDevice::free_physical(
    std::unordered_map<physical_handle, Physical>::iterator it) noexcept {
  if (backed_) arena_->deallocate(it->second.offset, it->second.size);
  bytes_created_ -= it->second.size;
  if (it->second.released) --released_still_mapped_;
  physical_.erase(it);
}

void HostDevice::release(physical_handle handle) {
  count(DriverCall::release);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto it = physical_.find(handle);
  if (it == physical_.end() || it->second.released)
    fail(DriverCall::release, "unknown or already released handle " + hex(handle),
         cu_result::invalid_value);
  if (it->second.mappings > 0) {  // freed when its last mapping goes
    it->second.released = true;
    ++released_still_mapped_;
  } else {
    free_physical(it);
  }
}

}  // namespace vmalloc
