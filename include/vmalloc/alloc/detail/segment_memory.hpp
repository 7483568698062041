// One segment's device memory for the caching allocator: what cudaMalloc hands PyTorch, built
// from the driver's virtual memory calls our Device offers so that every allocator's traffic
// is counted in the same units. A segment costs 4 driver-equivalent calls to make (cuMemCreate,
// cuMemAddressReserve, cuMemMap, cuMemSetAccess) and 3 to free (cuMemUnmap, cuMemAddressFree,
// cuMemRelease); a real cudaMalloc / cudaFree is one call each.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

class SegmentMemory {
 public:
  // Creates, reserves, maps and opens `size` bytes (a multiple of the device granularity).
  // Throws OutOfMemory when the device cannot create it, DeviceError for other failures;
  // either way nothing is left behind on the device -- unless the rollback fails too: then
  // what is left is appended to `leftovers` (when given), whose owner counts it and frees it
  // later, instead of being lost.
  SegmentMemory(Device& device, std::size_t size,
                std::vector<std::unique_ptr<SegmentMemory>>* leftovers = nullptr);
  // Frees what free() did not (best effort: a destructor never throws).
  ~SegmentMemory();
  SegmentMemory(const SegmentMemory&) = delete;
  SegmentMemory& operator=(const SegmentMemory&) = delete;

  // Unmaps the range, frees the reservation and releases the physical allocation. The caller
  // makes sure no queued work still uses the memory. Throws DeviceError; calling it again
  // after success is a no-op.
  void free();

  device_ptr ptr() const noexcept { return ptr_; }
  // True while the physical allocation is held (not yet released) / the range is mapped.
  bool created() const noexcept { return created_; }
  bool mapped() const noexcept { return mapped_; }
  // Moves what is still held into a new object; this one then holds nothing. Throws
  // bad_alloc (nothing changed).
  std::unique_ptr<SegmentMemory> hand_over() {
    std::unique_ptr<SegmentMemory> rest(new SegmentMemory(*this, Adopt{}));
    mapped_ = reserved_ = created_ = false;
    return rest;
  }
  std::size_t size() const noexcept { return size_; }

 private:
  struct Adopt {};
  SegmentMemory(const SegmentMemory& from, Adopt) noexcept
      : device_(from.device_), size_(from.size_), handle_(from.handle_), ptr_(from.ptr_),
        mapped_(from.mapped_), reserved_(from.reserved_), created_(from.created_) {}

  Device& device_;
  std::size_t size_;
  physical_handle handle_ = 0;
  device_ptr ptr_ = 0;
  bool mapped_ = false;
  bool reserved_ = false;
  bool created_ = false;
};

}  // namespace vmalloc::detail
