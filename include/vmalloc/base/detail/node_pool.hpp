// A recycling pool of bookkeeping nodes (ranges, blocks).
//
// Splitting a cached range or block needs a new node on the cache-hit path; taking it from a
// free list keeps the heap off that path once the pool has grown to the workload's size.
// The pool owns every node (RAII). Released nodes are NOT reset (resetting a node of ~100
// bytes costs more than the rest of a cache hit): whoever acquires one sets every field.
// Not thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace vmalloc::detail {

template <typename T>
class NodePool {
 public:
  T* acquire() {
    if (free_.empty()) {
      storage_.push_back(std::make_unique<T>());
      free_.reserve(storage_.capacity());  // release() below then never allocates
      return storage_.back().get();
    }
    T* node = free_.back();
    free_.pop_back();
    return node;
  }

  void release(T* node) noexcept {
    free_.push_back(node);  // capacity reserved in acquire(): no allocation, no throw
  }

  std::size_t live() const noexcept { return storage_.size() - free_.size(); }

 private:
  std::vector<std::unique_ptr<T>> storage_;
  std::vector<T*> free_;
};

}  // namespace vmalloc::detail
