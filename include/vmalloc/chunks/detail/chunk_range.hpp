// The VirtualAllocator's books: reservations of virtual address space and the runs of
// mapped chunks (ranges) inside them.
//
// A reservation is one cuMemAddressReserve of n chunk-sized slots. Each slot is unmapped or
// holds one chunk (its own cuMemMap), so a run of mapped slots can be split at any chunk
// boundary, or merged with its neighbour, without a driver call. Every mapped slot belongs
// to exactly one range: live (one allocation), cached (free, still mapped, reusable) or arena
// (sub-allocated by the SmallBlockArena).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vmalloc/chunks/detail/stream_order.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

struct ArenaChunk;
struct ChunkReservation;

enum class RangeState : std::uint8_t { live, cached, arena };

struct ChunkRange {
  ChunkReservation* reservation = nullptr;
  std::size_t first = 0;  // first slot
  std::size_t count = 0;  // slots (chunks)
  RangeState state = RangeState::cached;
  std::size_t requested = 0;    // live: the size asked for
  bool unbacked = false;        // live: chunks unmapped (VirtualAllocator::unmap_backing)
  PendingWork work;             // cached: what may still use the memory
  ArenaChunk* arena = nullptr;  // arena: the arena's record of this chunk
  ChunkRange* bucket_prev = nullptr;  // cached: size-bucket list hooks
  ChunkRange* bucket_next = nullptr;
  std::size_t bucket = 0;
};

struct ChunkReservation {
  device_ptr base = 0;
  std::size_t slots = 0;
  std::size_t mapped = 0;                // slots holding a chunk
  std::size_t unbacked = 0;              // live ranges here without chunks: keep the range
  std::vector<physical_handle> handles;  // per slot; 0 = unmapped
  // A new reservation whose mapping failed and whose rollback failed too: its first `mapped`
  // slots hold chunks (not accessible, in no range) that the allocator still owns;
  // release_cached() retries the teardown, the destructor does it.
  bool quarantined = false;
  // The range starting / ending at each slot. Entries inside or outside current ranges may
  // be stale: read them only through range_starting_at / range_ending_at, which check.
  std::vector<ChunkRange*> head;
  std::vector<ChunkRange*> tail;

  ChunkRange* range_starting_at(std::size_t slot) const noexcept {
    if (slot >= slots) return nullptr;
    ChunkRange* r = head[slot];
    return r != nullptr && r->reservation == this && r->first == slot ? r : nullptr;
  }
  ChunkRange* range_ending_at(std::size_t slot) const noexcept {
    if (slot >= slots) return nullptr;
    ChunkRange* r = tail[slot];
    return r != nullptr && r->reservation == this && r->count != 0 &&
                   r->first + r->count - 1 == slot
               ? r
               : nullptr;
  }
  void set_bounds(ChunkRange* r) noexcept {
    head[r->first] = r;
    tail[r->first + r->count - 1] = r;
  }
  // The range covering `slot` (error messages only: linear).
  ChunkRange* range_covering(std::size_t slot) const noexcept {
    for (std::size_t i = slot + 1; i-- > 0;)
      if (ChunkRange* r = range_starting_at(i)) return r->first + r->count > slot ? r : nullptr;
    return nullptr;
  }
};

}  // namespace vmalloc::detail
