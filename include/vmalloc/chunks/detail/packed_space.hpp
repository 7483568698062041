// The PackedVirtualAllocator's books: reservations of virtual address space divided into
// chunk slots, and the blocks (live allocations and free holes) laid back to back in them.
//
// Blocks tile a reservation with no gap, at 512-byte granularity, in an address-ordered list;
// there are no segment boundaries inside a reservation, so a hole can span chunk boundaries
// and neighbouring holes always merge (when their streams allow). Physical backing is per
// slot: a slot is unmapped or holds one chunk, and counts the live blocks that overlap it.
// A mapped slot that no live block overlaps is a fully free chunk: reusable in place, or
// stolen (unmapped and remapped) for a slot elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vmalloc/chunks/detail/stream_order.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

struct PackedReservation;

// Which hole index a reservation's holes live in: requests of at most the small threshold are
// packed apart from the others, so that small long-lived blocks do not pin chunks among large
// tensors.
enum class HoleKind : std::uint8_t { small, large };

// Placement unit of the packed allocator.
inline constexpr std::size_t packed_block_bytes = 512;

struct PackedBlock {
  PackedReservation* reservation = nullptr;
  std::size_t offset = 0;      // bytes from the reservation's base
  std::size_t size = 0;        // bytes, a multiple of packed_block_bytes
  std::size_t requested = 0;   // live: the size asked for
  PackedBlock* prev = nullptr;  // address-ordered neighbours in the reservation
  PackedBlock* next = nullptr;
  bool free = true;
  PendingWork work;            // free: what may still use the memory
  PackedBlock* bucket_prev = nullptr;  // free: hole-index hooks
  PackedBlock* bucket_next = nullptr;
  std::size_t bucket = 0;

  std::size_t end() const noexcept { return offset + size; }
};

struct PackedReservation {
  device_ptr base = 0;
  std::size_t slots = 0;
  HoleKind kind = HoleKind::large;          // which hole index its holes live in
  std::vector<physical_handle> handles;     // per slot: the mapped chunk, or 0
  std::vector<std::uint32_t> live;          // per slot: live blocks overlapping it
  std::vector<std::uint8_t> robbed;         // per slot: unmapped by stealing, not mapped since
  std::size_t mapped = 0;                   // slots with a chunk
  std::size_t live_blocks = 0;
  PackedBlock* first = nullptr;             // the lowest block; blocks tile the reservation

  device_ptr address_of(const PackedBlock* b) const noexcept { return base + b->offset; }
};

}  // namespace vmalloc::detail
