// AllocationCounters: the Stats an allocator counts on its own (requested, allocated and live
// bytes and counts, totals, out-of-memory count) with their peaks. Reserved bytes come from
// elsewhere (a chunk pool), so they are passed in. Not thread-safe: the owner's lock guards it.
#pragma once

#include <algorithm>
#include <cstddef>

#include "vmalloc/base/stats.hpp"

namespace vmalloc::detail {

class AllocationCounters {
 public:
  void count_allocation(std::size_t requested, std::size_t allocated) noexcept {
    Stats& s = stats_;
    s.requested_bytes += requested;
    s.allocated_bytes += allocated;
    ++s.live_allocations;
    ++s.total_allocations;
    s.peak_requested_bytes = std::max(s.peak_requested_bytes, s.requested_bytes);
    s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, s.allocated_bytes);
    s.peak_internal_fragmentation_bytes =
        std::max(s.peak_internal_fragmentation_bytes, s.allocated_bytes - s.requested_bytes);
    s.peak_live_allocations = std::max(s.peak_live_allocations, s.live_allocations);
  }

  void count_deallocation(std::size_t requested, std::size_t allocated) noexcept {
    stats_.requested_bytes -= requested;
    stats_.allocated_bytes -= allocated;
    --stats_.live_allocations;
    ++stats_.total_deallocations;
  }

  // A live allocation loses (unback) or regains (reback) its physical backing: it stays live
  // (counted in live_allocations) but its bytes leave requested and allocated bytes while it
  // has no memory (VirtualAllocator::unmap_backing / map_backing).
  void unback(std::size_t requested, std::size_t allocated) noexcept {
    stats_.requested_bytes -= requested;
    stats_.allocated_bytes -= allocated;
  }
  void reback(std::size_t requested, std::size_t allocated) noexcept {
    Stats& s = stats_;
    s.requested_bytes += requested;
    s.allocated_bytes += allocated;
    s.peak_requested_bytes = std::max(s.peak_requested_bytes, s.requested_bytes);
    s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, s.allocated_bytes);
    s.peak_internal_fragmentation_bytes =
        std::max(s.peak_internal_fragmentation_bytes, s.allocated_bytes - s.requested_bytes);
  }

  void count_out_of_memory() noexcept { ++stats_.out_of_memory_count; }

  // Raises the reserved peak to `reserved_bytes` now held (the peak between snapshots).
  void note_reserved(std::size_t reserved_bytes) noexcept {
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, reserved_bytes);
  }

  // The full Stats with `reserved_bytes` held now.
  Stats snapshot(std::size_t reserved_bytes) const noexcept {
    Stats s = stats_;
    s.reserved_bytes = reserved_bytes;
    s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
    s.cached_bytes = s.reserved_bytes - s.allocated_bytes;
    s.internal_fragmentation_bytes = s.allocated_bytes - s.requested_bytes;
    return s;
  }

  // Every peak back to its current value, with `reserved_bytes` held now.
  void reset_peaks(std::size_t reserved_bytes) noexcept {
    Stats& s = stats_;
    s.peak_requested_bytes = s.requested_bytes;
    s.peak_allocated_bytes = s.allocated_bytes;
    s.peak_internal_fragmentation_bytes = s.allocated_bytes - s.requested_bytes;
    s.peak_live_allocations = s.live_allocations;
    s.peak_reserved_bytes = reserved_bytes;
  }

  std::size_t live_allocations() const noexcept { return stats_.live_allocations; }

 private:
  Stats stats_;  // reserved_bytes, cached_bytes, internal_fragmentation_bytes unused here
};

}  // namespace vmalloc::detail
