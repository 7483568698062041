// PackedVirtualAllocator: the virtual allocator with packed placement.
//
// VirtualAllocator gives a request of mr bytes k = ceil(mr / mc) whole chunks, so every
// allocation wastes up to a chunk (a 2.25 MiB tensor holds 4 MiB). Here allocations are
// packed back to back in large reservations of virtual address space at 512-byte granularity,
// best fit by (size, address) over the free holes of all reservations, with free neighbours
// merged and no segment boundaries inside a reservation. Physical chunks back only the chunk
// slots that live blocks overlap: two 2.25 MiB tensors share 3 chunks.
//
// Backing a placed block: its unmapped slots get chunks from the pool's cache, else chunks
// stolen from fully free mapped slots elsewhere whose frees' work is done (unmap + map +
// set_access is far cheaper than cuMemCreate, and keeps reserved memory at what live blocks
// touch; but a slot stolen before and needed again gets a new chunk, within 1/16 above the
// peak of touched slots and 1/64 of it per allocation, so that a periodic loop stops moving
// chunks back and forth), else new chunks within budget and capacity, else (under pressure)
// chunks stolen after waiting for their work (or new chunks before any stealing:
// steal_before_create = false); one cuMemSetAccess per contiguous run. Freed slots stay mapped, so a repeated pattern whose
// blocks land on mapped slots makes no memory-management driver call.
// No out-of-memory while ceil(mr / mc) fully free chunks exist: when the best hole would need
// more chunks than are free, the block goes to a fresh chunk-aligned reservation.
//
// Streams: see detail/stream_order.hpp; each hole keeps its freeing stream and work, holes of
// different busy streams do not merge. Thread-safe: one mutex around every public method.
// See docs/virtual_allocator.rst, "Packed placement".
// The steps both placements share (checks, "enough chunks?", errors, stats) are in
// detail/chunk_allocator_core.hpp; gathering chunks with an undo in detail/chunk_batch.hpp.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/alloc/chunk_options.hpp"
#include "vmalloc/alloc/chunk_stats.hpp"
#include "vmalloc/alloc/detail/chunk_allocator_core.hpp"
#include "vmalloc/alloc/detail/chunk_batch.hpp"
#include "vmalloc/base/detail/node_pool.hpp"
#include "vmalloc/chunks/detail/hole_index.hpp"
#include "vmalloc/chunks/detail/packed_space.hpp"

namespace vmalloc {

// chunk_size and budget: ChunkOptions.
struct PackedVirtualAllocatorOptions : ChunkOptions {
  // Requests of at most this many bytes are packed in reservations of their own, apart from
  // larger ones, so that small long-lived blocks do not pin chunks among large tensors (as
  // PyTorch's small pool). 0 packs everything together. default_small_threshold: 1 MiB.
  static constexpr std::size_t default_small_threshold = static_cast<std::size_t>(-1);
  std::size_t small_threshold = default_small_threshold;
  // Virtual bytes per reservation (rounded up to chunks); a larger request gets its own size.
  // 0 picks 1 GiB. Address space is cheap and packing is densest inside one reservation.
  std::size_t reservation_size = 0;
  // Where the chunks for newly touched slots come from after the pool's cache. true: chunks
  // stolen from fully free mapped slots first (those whose frees' work is done: no host
  // wait), new chunks only when none is free or for a slot that was stolen and is needed
  // again, while the chunks held stay within peak + peak * remap_slack (peak: the most slots
  // live blocks touched at once; at most max(1, peak / 64) such chunks per allocation): a
  // pattern whose live blocks move across more slots than that margin remaps chunks every time.
  // false: new chunks first, stealing only at the budget or capacity: every slot a pattern
  // touches stays mapped, so a repeated pattern makes no driver call after warm-up; the
  // device needed is the same, more is held when memory is plentiful.
  bool steal_before_create = true;
  // With steal_before_create: the fraction above the peak of touched slots that may be held
  // so that a repeating step whose blocks touch more slots over the step than at once stops
  // remapping (0: always steal, the least held; 1/16 settles typical training steps). In
  // [0, 1]; InvalidArgument otherwise.
  double remap_slack = 0.0;
};

// Detail beyond Stats (VirtualAllocator(placement="packed").packed_stats() in Python). Of the
// common fields, chunks_held = live + free_mapped + in_pool, chunks_live are the mapped slots
// some live block overlaps, free_chunks = free_mapped + in_pool.
struct PackedStats : CommonChunkStats {
  std::size_t reservation_size = 0;
  bool steal_before_create = true;
  double remap_slack = 0.0;
  std::size_t chunks_free_mapped = 0;   // mapped slots no live block overlaps
  std::size_t live_blocks = 0;
  std::size_t free_holes = 0;
  std::size_t hole_bytes = 0;           // free bytes inside reservations (mapped or not)
  std::size_t fresh_placements = 0;     // blocks moved to a fresh reservation under pressure
};

class PackedVirtualAllocator final : public Allocator, private detail::ChunkAllocatorCore {
 public:
  // Throws InvalidArgument for a null device, a chunk size that is zero or not a multiple of
  // the device granularity, a budget below one chunk, or a reservation size above 2**56.
  PackedVirtualAllocator(std::shared_ptr<Device> device,
                         const PackedVirtualAllocatorOptions& options = {});
  static std::shared_ptr<PackedVirtualAllocator> create(
      std::shared_ptr<Device> device, const PackedVirtualAllocatorOptions& options = {});
  // Waits for the device, unmaps everything, frees every reservation and releases every chunk.
  ~PackedVirtualAllocator() override;

  device_ptr allocate(std::size_t nbytes, stream_t stream) override;
  void deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) override;
  std::size_t release_cached() override;
  Stats stats() const override { return current_stats(); }
  void reset_peak_stats() override { reset_peaks(); }
  std::size_t allocation_size(device_ptr ptr) const override;
  std::vector<std::pair<device_ptr, std::size_t>> live_allocations() const override;
  std::string name() const override { return "virtual-packed"; }
  const std::shared_ptr<Device>& device() const override { return device_; }

  PackedStats packed_stats() const;
  // The same detail in VirtualAllocator's shape: live = chunks_live, cached =
  // chunks_free_mapped, cached_ranges = free holes, live_ranges = live blocks, no arenas.
  ChunkStats chunk_stats() const;
  std::size_t chunk_size() const noexcept { return chunk_size_; }
  std::size_t small_threshold() const noexcept { return small_threshold_; }
  std::size_t reservation_size() const noexcept { return reservation_size_; }
  bool steal_before_create() const noexcept { return steal_before_create_; }
  double remap_slack() const noexcept { return remap_slack_; }
  std::size_t budget() const noexcept { return pool_.budget(); }

 private:
  using Block = detail::PackedBlock;
  using HoleKind = detail::HoleKind;
  using Reservation = detail::PackedReservation;
  struct Slot {
    Reservation* reservation;
    std::size_t index;
  };

  // All private members run with mutex_ held.
  // A new reservation of at least `bytes` for holes of `kind`, one free hole. Throws.
  Block* new_reservation(std::size_t bytes, HoleKind kind);
  detail::HoleIndex& holes(HoleKind kind) noexcept {
    return kind == HoleKind::small ? small_holes_ : large_holes_;
  }
  // Maps chunks into the unmapped slots [first, last] of `res` (pool cache, stolen, created).
  // On failure nothing is mapped there and every chunk obtained is back in the pool (created
  // ones released): reserved bytes as before.
  void back_slots(Reservation* res, std::size_t first, std::size_t last, std::size_t need,
                  std::size_t nbytes);
  // Unmaps up to `need` fully free mapped slots outside [keep_first, keep_last] of `keep`
  // into `out`. wait: blocks the host for the work of the holes on them; otherwise takes
  // only slots whose holes' work is done (no host wait).
  void steal(std::size_t need, const Reservation* keep, std::size_t keep_first,
             std::size_t keep_last, std::vector<physical_handle>& out, bool wait);
  // True if the work of every hole overlapping slots [first, last] of `res` is done.
  // `cursor`: a block of `res` to start the search from (nullptr: the first), set to the
  // block holding slot `first`'s first byte, so descending calls cost one walk in all.
  bool holes_done(Reservation* res, std::size_t first, std::size_t last, Block*& cursor);
  // Unmaps slots [first, last] of `res` (all mapped, no live block); chunks into `out`.
  void unmap_slots(Reservation* res, std::size_t first, std::size_t last,
                   std::vector<physical_handle>& out);
  // Waits for the work of every hole overlapping slots [first, last] of `res`.
  void synchronize_holes(Reservation* res, std::size_t first, std::size_t last);
  // Puts a free block into the index, merged with free neighbours its stream allows.
  void insert_hole(Block* b) noexcept;
  // Frees a reservation with no live block and no mapped slot (not `keep`).
  void drop_reservation_if_empty(Reservation* res, const Reservation* keep = nullptr);
  std::size_t slot_first(const Block* b) const noexcept { return slot_of(b->offset); }
  std::size_t slot_last(const Block* b) const noexcept { return slot_of(b->offset + b->size - 1); }
  std::size_t free_mapped_in(const Reservation* res, std::size_t first,
                             std::size_t last) const noexcept;
  std::size_t unmapped_in(const Reservation* res, std::size_t first,
                          std::size_t last) const noexcept;
  [[noreturn]] void throw_invalid_pointer(device_ptr ptr, const char* operation) const;

  const std::size_t small_threshold_;
  const std::size_t reservation_size_;
  const bool steal_before_create_;
  const double remap_slack_;
  detail::NodePool<Block> blocks_;
  detail::HoleIndex small_holes_;  // holes of reservations for requests <= small_threshold_
  detail::HoleIndex large_holes_;  // those of the others
  std::map<device_ptr, std::unique_ptr<Reservation>> reservations_;
  // live_ (ChunkAllocatorCore) values: the live blocks (Block*).
  std::size_t live_slots_ = 0;  // mapped slots with live blocks
  std::size_t peak_live_slots_ = 0;  // the most mapped slots with live blocks at once
  std::size_t free_mapped_ = 0; // mapped slots without
  std::size_t fresh_ = 0;
};

}  // namespace vmalloc
