// The memory of one expandable segment (PyTorch's ExpandableSegment in
// c10/cuda/CUDACachingAllocator.cpp, used with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True):
// one large reservation of virtual address space, cut into pages of a fixed size (2 MiB for the
// small pool, 20 MiB for the large pool) that are created and mapped on demand and unmapped
// and released when the caching allocator shrinks the segment.
//
// Driver calls, as PyTorch makes them: growing pages [first, last) costs one cuMemCreate and
// one cuMemMap per page and one cuMemSetAccess over the whole range; shrinking costs one
// cuMemUnmap and one cuMemRelease per page (the caller synchronizes first); the reservation is
// one cuMemAddressReserve at construction and one cuMemAddressFree at free().
#pragma once

#include <cstddef>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

class ExpandableMemory {
 public:
  // Reserves `size` bytes (a multiple of page_size, itself a multiple of the device
  // granularity). Throws OutOfMemory or DeviceError from the reservation.
  ExpandableMemory(Device& device, std::size_t size, std::size_t page_size);
  // Unmaps and releases every page and frees the reservation (best effort).
  ~ExpandableMemory();
  ExpandableMemory(const ExpandableMemory&) = delete;
  ExpandableMemory& operator=(const ExpandableMemory&) = delete;

  // Creates, maps and opens pages [first, last), all currently unmapped (or stuck, see
  // stuck_bytes: those are reused as they are). Returns false with nothing changed when the
  // device is out of memory (PyTorch releases the pages it created and reports a failed map);
  // other failures are rolled back and rethrown.
  bool map(std::size_t first, std::size_t last);
  // Pages whose unmap failed during a rollback: still mapped (not accessible) and holding
  // their physical memory, so they are kept, not forgotten; a later map() over them reuses
  // them and free() releases them.
  std::size_t stuck_bytes() const noexcept { return stuck_pages_ * page_; }
  // Unmaps and releases pages [first, last), all mapped. `done` counts the pages unmapped,
  // also when a driver call throws part way (those pages are gone; the rest stay mapped).
  void unmap(std::size_t first, std::size_t last, std::size_t& done);
  // Unmaps every mapped page and frees the reservation. Throws DeviceError; again is a no-op.
  void free();

  device_ptr ptr() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t page_size() const noexcept { return page_; }
  std::size_t mapped_bytes() const noexcept { return mapped_pages_ * page_; }
  bool is_mapped(std::size_t page) const noexcept {
    return page < pages_.size() && pages_[page].mapped;
  }

 private:
  Device& device_;
  std::size_t size_;
  std::size_t page_;
  device_ptr ptr_ = 0;
  bool reserved_ = false;
  struct Page {
    physical_handle handle = 0;
    bool mapped = false;
    bool stuck = false;  // mapped by a map() whose rollback could not unmap it
  };
  std::vector<Page> pages_;  // grown on demand, like PyTorch's handles_
  std::size_t mapped_pages_ = 0;  // mapped and usable (stuck pages not included)
  std::size_t stuck_pages_ = 0;
};

}  // namespace vmalloc::detail
