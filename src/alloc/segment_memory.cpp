#include "vmalloc/alloc/detail/segment_memory.hpp"

namespace vmalloc::detail {

SegmentMemory::SegmentMemory(Device& device, std::size_t size,
                             std::vector<std::unique_ptr<SegmentMemory>>* leftovers)
    : device_(device), size_(size) {
  handle_ = device_.create(size_);
  created_ = true;
  try {
    ptr_ = device_.reserve(size_, device_.granularity());
    reserved_ = true;
    device_.map(ptr_, size_, handle_);
    mapped_ = true;
    device_.set_access(ptr_, size_);
  } catch (...) {
    // Undo in reverse order so a failed constructor leaves the device as it was.
    try {
      free();
    } catch (...) {
      // The rollback failed too: hand what is left to the owner rather than lose it.
      if (leftovers != nullptr) {
        try {
          leftovers->push_back(std::unique_ptr<SegmentMemory>(new SegmentMemory(*this, Adopt{})));
        } catch (...) {
        }
      }
    }
    throw;
  }
}

SegmentMemory::~SegmentMemory() {
  try {
    free();
  } catch (...) {
  }
}

void SegmentMemory::free() {
  if (mapped_) {
    device_.unmap(ptr_, size_);
    mapped_ = false;
  }
  if (reserved_) {
    device_.free_address(ptr_, size_);
    reserved_ = false;
  }
  if (created_) {
    device_.release(handle_);
    created_ = false;
  }
}

}  // namespace vmalloc::detail
