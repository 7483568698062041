// The caching allocator's bookkeeping: a segment (one device allocation) is cut into blocks,
// kept in address order; free blocks sit in a pool ordered for best fit by
// (stream, size, address), as in PyTorch's CUDACachingAllocator.
#pragma once

#include <cstddef>
#include <iterator>
#include <list>
#include <memory>
#include <set>
#include <tuple>
#include <vector>

#include "vmalloc/alloc/detail/expandable_memory.hpp"
#include "vmalloc/alloc/detail/segment_memory.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

struct CachingSegment;

struct CachingBlock {
  CachingBlock(device_ptr ptr_, std::size_t size_, stream_t stream_, stream_t pool_stream_,
               CachingSegment* segment_)
      : ptr(ptr_), size(size_), stream(stream_), pool_stream(pool_stream_), segment(segment_) {}

  device_ptr ptr;
  std::size_t size;
  stream_t stream;       // the allocation stream: reuse on it needs no synchronization
  stream_t pool_stream;  // the stream part of the pool key (0 for stream-unaware policies)
  CachingSegment* segment;
  std::list<CachingBlock>::iterator self;  // position in segment->blocks
  std::size_t requested = 0;  // the caller's size while allocated
  bool allocated = false;
  int pending_events = 0;     // events recorded at free time that have not completed
  std::vector<stream_t> stream_uses;  // other streams that used it (record_stream)
  bool mapped = true;         // false: unmapped address space of an expandable segment

  // In a pool: neither handed out nor waiting for other streams.
  bool is_free() const noexcept { return !allocated && pending_events == 0; }
};

struct CachingSegment {
  // A fixed segment: one device allocation of `size` bytes (cudaMalloc). What a failed
  // rollback leaves goes to `leftovers` (see SegmentMemory).
  CachingSegment(Device& device, std::size_t size, bool small_, stream_t stream_,
                 std::vector<std::unique_ptr<SegmentMemory>>* leftovers = nullptr)
      : memory(std::make_unique<SegmentMemory>(device, size, leftovers)),
        small(small_),
        stream(stream_) {}
  // An expandable segment: `size` bytes of address space mapped in pages of `page_size`.
  CachingSegment(Device& device, std::size_t size, std::size_t page_size, bool small_,
                 stream_t stream_)
      : expandable(std::make_unique<ExpandableMemory>(device, size, page_size)),
        small(small_),
        stream(stream_) {}

  std::unique_ptr<SegmentMemory> memory;        // set for a fixed segment
  std::unique_ptr<ExpandableMemory> expandable; // set for an expandable segment
  device_ptr ptr() const noexcept { return memory ? memory->ptr() : expandable->ptr(); }
  std::size_t size() const noexcept { return memory ? memory->size() : expandable->size(); }
  bool small;       // which pool its blocks belong to
  stream_t stream;  // the stream it was created for
  std::list<CachingBlock> blocks;  // address order, covering the segment exactly

  CachingBlock* prev(const CachingBlock* b) {
    return b->self == blocks.begin() ? nullptr : &*std::prev(b->self);
  }
  CachingBlock* next(const CachingBlock* b) {
    auto n = std::next(b->self);
    return n == blocks.end() ? nullptr : &*n;
  }
  // One block covering the whole segment (PyTorch: a block that is not split).
  bool unsplit() const noexcept { return blocks.size() == 1; }
};

// Best-fit order. Searched with a Key, so no dummy block is needed for lookups.
struct BlockOrder {
  using is_transparent = void;
  struct Key {
    stream_t stream;
    std::size_t size;
    device_ptr ptr;
  };
  static auto tie(const CachingBlock* b) { return std::tie(b->pool_stream, b->size, b->ptr); }
  static auto tie(const Key& k) { return std::tie(k.stream, k.size, k.ptr); }
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    return tie(a) < tie(b);
  }
};

using BlockPool = std::set<CachingBlock*, BlockOrder>;

// The unmapped address space of expandable segments, by (stream, address) like PyTorch's
// BlockPool::unmapped (BlockComparatorAddress).
struct AddressOrder {
  using is_transparent = void;
  struct Key {
    stream_t stream;
    device_ptr ptr;
  };
  static auto tie(const CachingBlock* b) { return std::tie(b->pool_stream, b->ptr); }
  static auto tie(const Key& k) { return std::tie(k.stream, k.ptr); }
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    return tie(a) < tie(b);
  }
};

using UnmappedPool = std::set<CachingBlock*, AddressOrder>;

}  // namespace vmalloc::detail
