#include "vmalloc/alloc/detail/expandable_memory.hpp"

#include "vmalloc/base/errors.hpp"

namespace vmalloc::detail {

ExpandableMemory::ExpandableMemory(Device& device, std::size_t size, std::size_t page_size)
    : device_(device), size_(size), page_(page_size) {
  // PyTorch: cuMemAddressReserve(&ptr_, segment_size_ * max_handles_, 0, 0, 0).
  ptr_ = device_.reserve(size_, 0);
  reserved_ = true;
}

ExpandableMemory::~ExpandableMemory() {
  try {
    free();
  } catch (...) {
  }
}

bool ExpandableMemory::map(std::size_t first, std::size_t last) {
  if (pages_.size() < last) pages_.resize(last);
  // Stuck pages in the range are mapped already: reused, not created or mapped again.
  std::vector<std::size_t> fresh;
  fresh.reserve(last - first);
  for (std::size_t i = first; i < last; ++i)
    if (!pages_[i].stuck) fresh.push_back(i);
  std::size_t created = 0;
  std::size_t mapped = 0;
  auto undo = [&] {
    for (std::size_t k = 0; k < mapped; ++k) {
      Page& p = pages_[fresh[k]];
      try {
        device_.unmap(ptr_ + fresh[k] * page_, page_);
        p.mapped = false;
      } catch (...) {
        // Still mapped: keep it (and its memory) as stuck rather than forget it.
        p.stuck = true;
        ++stuck_pages_;
      }
    }
    for (std::size_t k = 0; k < created; ++k) {
      Page& p = pages_[fresh[k]];
      if (p.stuck) continue;
      try {
        device_.release(p.handle);
      } catch (...) {
      }
      p.handle = 0;
    }
  };
  try {
    // One cuMemCreate per page; out of memory releases what this call created.
    for (; created < fresh.size(); ++created)
      pages_[fresh[created]].handle = device_.create(page_);
    for (; mapped < fresh.size(); ++mapped) {
      const std::size_t i = fresh[mapped];
      device_.map(ptr_ + i * page_, page_, pages_[i].handle);
      pages_[i].mapped = true;
    }
    device_.set_access(ptr_ + first * page_, (last - first) * page_);
  } catch (const OutOfMemory&) {
    undo();
    return false;
  } catch (...) {
    undo();
    throw;
  }
  for (std::size_t i = first; i < last; ++i) {
    if (pages_[i].stuck) {
      pages_[i].stuck = false;
      --stuck_pages_;
    }
  }
  mapped_pages_ += last - first;
  return true;
}

void ExpandableMemory::unmap(std::size_t first, std::size_t last, std::size_t& done) {
  done = 0;
  for (std::size_t i = first; i < last; ++i) {
    const device_ptr at = ptr_ + i * page_;
    device_.unmap(at, page_);  // throws: page i stays mapped
    try {
      device_.release(pages_[i].handle);
    } catch (...) {
      // A failed call changes nothing: map the page back, so that it stays usable (if that
      // fails too, the page is lost to this segment but never handed out unmapped).
      try {
        device_.map(at, page_, pages_[i].handle);
        device_.set_access(at, page_);
      } catch (...) {
        pages_[i].mapped = false;
        --mapped_pages_;
        ++done;
      }
      throw;
    }
    pages_[i].handle = 0;
    pages_[i].mapped = false;
    --mapped_pages_;
    ++done;
  }
}

void ExpandableMemory::free() {
  for (std::size_t i = 0; i < pages_.size(); ++i) {
    if (!pages_[i].mapped) continue;
    if (pages_[i].stuck) {
      device_.unmap(ptr_ + i * page_, page_);  // throws: still stuck, kept
      pages_[i].mapped = false;
      pages_[i].stuck = false;
      --stuck_pages_;
      try {
        device_.release(pages_[i].handle);
      } catch (...) {
      }
      pages_[i].handle = 0;
      continue;
    }
    std::size_t done = 0;
    unmap(i, i + 1, done);
  }
  pages_.clear();
  if (reserved_) {
    device_.free_address(ptr_, size_);
    reserved_ = false;
  }
}

}  // namespace vmalloc::detail
