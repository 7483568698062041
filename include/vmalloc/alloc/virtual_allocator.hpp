// VirtualAllocator: the paper's virtual-addressing allocator (Hayakawa & Narihira, section 4).
//
// A request of mr bytes gets k = ceil(mr / mc) physical chunks of mc bytes, any chunks, mapped
// into one contiguous reserved virtual range (one cuMemMap per chunk, one cuMemSetAccess over
// the run). Physical memory therefore never fragments: a request succeeds whenever k chunks are
// free anywhere, and internal fragmentation per allocation stays below one chunk (equation 1).
//
// Freed ranges stay mapped in a cache keyed by chunk count (best fit). Every chunk being its
// own mapping, a larger cached range is split at a chunk boundary and neighbours in one
// reservation merge with no driver call, so a periodic training loop makes no
// memory-management driver call after warm-up. On a miss: chunks from the pool's cache, then
// new chunks (within budget and capacity), then chunks stolen from cached ranges and empty
// arena chunks (synchronized, unmapped, remapped). Requests up to the small threshold are
// sub-allocated in 512-byte blocks inside arena chunks.
//
// Streams: see detail/stream_order.hpp. Thread-safe: one mutex around every public method.
// See docs/virtual_allocator.rst.
// The steps both placements share (checks, "enough chunks?", errors, stats) are in
// detail/chunk_allocator_core.hpp; gathering chunks with an undo in detail/chunk_batch.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
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
#include "vmalloc/base/detail/size_buckets.hpp"
#include "vmalloc/chunks/detail/chunk_range.hpp"
#include "vmalloc/chunks/detail/small_block_arena.hpp"

namespace vmalloc {

// chunk_size and budget: ChunkOptions.
struct VirtualAllocatorOptions : ChunkOptions {
  // Requests of at most this many bytes are sub-allocated in arena chunks; at most chunk_size;
  // 0 disables sub-allocation. default_small_threshold picks chunk_size / 2: above that the
  // chunk path wastes less than the request itself, below it a chunk would be mostly waste.
  static constexpr std::size_t default_small_threshold = static_cast<std::size_t>(-1);
  std::size_t small_threshold = default_small_threshold;
  // On a miss, after the pool's cache: true steals chunks from cached ranges and empty arena
  // chunks whose frees' work is done (polled, no host wait) before creating new chunks, so
  // what is held stays near the peak of what is live; false (the default) creates first and
  // steals only at the budget or the capacity, so that cached ranges survive for the next
  // iteration and a repeated pattern makes no driver call after warm-up.
  bool steal_before_create = false;
};

class VirtualAllocator final : public Allocator, private detail::ChunkAllocatorCore {
 public:
  // Throws InvalidArgument for a null device, a chunk size that is zero or not a multiple of
  // the device granularity, a budget below one chunk, or a small threshold above a chunk.
  VirtualAllocator(std::shared_ptr<Device> device, const VirtualAllocatorOptions& options = {});
  static std::shared_ptr<VirtualAllocator> create(std::shared_ptr<Device> device,
                                                  const VirtualAllocatorOptions& options = {});
  // Waits for the device, unmaps everything, frees every reservation and releases every chunk.
  ~VirtualAllocator() override;

  device_ptr allocate(std::size_t nbytes, stream_t stream) override;
  void deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) override;
  std::size_t release_cached() override;
  Stats stats() const override { return current_stats(); }
  void reset_peak_stats() override { reset_peaks(); }
  std::size_t allocation_size(device_ptr ptr) const override;
  std::vector<std::pair<device_ptr, std::size_t>> live_allocations() const override;
  std::string name() const override { return "virtual"; }
  const std::shared_ptr<Device>& device() const override { return device_; }

  ChunkStats chunk_stats() const;

  // --- pointer-stable swapping (the SwapManager's primitives, docs/swap_manager.rst) ---
  // True if the live allocation at `ptr` owns whole chunks (the chunk path: requests above
  // small_threshold), so that its chunks can be unmapped alone; false for a sub-allocated
  // small block, which shares its chunk. Throws InvalidPointer for a pointer not live here.
  bool owns_chunks(device_ptr ptr) const;
  // True if `ptr` is live and currently unbacked (after unmap_backing). Throws InvalidPointer.
  bool is_unbacked(device_ptr ptr) const;
  // Unmaps the chunks of the live chunk-path allocation at `ptr` and returns them to the
  // chunk pool (other allocations may take them); the virtual range stays reserved and the
  // allocation stays live, unbacked: touching it faults until map_backing. Work queued on
  // `stream` before this call may still use the memory, so with `synchronize` the host first
  // waits for `stream` (cuMemUnmap does not order with streams); pass false only when the
  // caller knows that every use of the memory has completed (an event it saw complete).
  // Throws InvalidPointer (not live here), InvalidArgument (a small block, or already
  // unbacked), DeviceError; a failed call changes nothing.
  void unmap_backing(device_ptr ptr, stream_t stream, bool synchronize = true);
  // Maps k chunks (the pool's cache, new ones within budget and capacity, stolen from cached
  // ranges as allocate() would) at the unbacked allocation's own address and sets access:
  // the pointer is the same, the contents undefined. Throws OutOfMemory or DeviceError with
  // nothing changed, InvalidPointer / InvalidArgument (not unbacked).
  void map_backing(device_ptr ptr, stream_t stream);

  std::size_t chunk_size() const noexcept { return chunk_size_; }
  std::size_t small_threshold() const noexcept { return small_threshold_; }
  std::size_t budget() const noexcept { return pool_.budget(); }
  bool steal_before_create() const noexcept { return steal_before_create_; }

 private:
  using Range = detail::ChunkRange;
  using Reservation = detail::ChunkReservation;

  // All private members run with mutex_ held.
  device_ptr allocate_chunks(std::size_t nbytes, stream_t stream);
  device_ptr allocate_small(std::size_t nbytes, stream_t stream);
  // The small path's miss: a chunk joins the arena; returns a block of it. Out of line (cold)
  // so that the hit path compiles into allocate().
  __attribute__((noinline)) detail::ArenaBlock* grow_arena(std::size_t nbytes, stream_t stream);
  // A cached range of >= k chunks, cut to k and made usable on `stream`; nullptr on a miss.
  Range* take_cached(std::size_t k, stream_t stream);
  // A new reservation of k chunks, mapped and accessible. Throws OutOfMemory (accounting
  // unchanged), DeviceError.
  Range* map_new_range(std::size_t k, std::size_t nbytes, stream_t stream);
  // Fills `batch` in allocate's and map_backing's order (ChunkBatch::gather: the pool's
  // cache, stealing first if steal_before_create, new chunks, then stealing under pressure).
  void gather(detail::ChunkBatch& batch);
  // Maps the full `batch` at `base`, chunk i at slot i, and makes the run accessible (a new
  // mapping starts inaccessible) with one cuMemSetAccess. `mapped`: how many are mapped, for
  // the caller's rollback when a call throws.
  void map_run(device_ptr base, const detail::ChunkBatch& batch, std::size_t& mapped);
  // Unmaps the chunks an earlier map_backing of the unbacked range `r` left mapped (its
  // rollback failed) and gives them back to the pool. Throws DeviceError, nothing changed.
  void unmap_leftovers(Range* r);
  // Chunks that stealing may free: those of cached ranges and empty arena chunks.
  std::size_t stealable_chunks() const noexcept { return cached_chunks_ + arena_.empty_chunks(); }
  // Unmaps up to `need` chunks from cached ranges and empty arena chunks into `out`. With
  // `wait` false, only those whose frees' work is done (polled: no host wait) are taken.
  void steal(std::size_t need, std::vector<physical_handle>& out, bool wait);
  // Unmaps the last `take` chunks of a cached range whose work is done; handles into `out`.
  void unmap_tail(Range* range, std::size_t take, std::vector<physical_handle>& out);
  // Puts a free range into the cache, merging it with cached neighbours.
  void cache_range(Range* range) noexcept;
  // The live_ value at ptr; throws InvalidPointer for a pointer not live here.
  std::uintptr_t live_value(device_ptr ptr, const char* operation) const;
  // The live chunk-path range at ptr, for the swap primitives; throws InvalidPointer or
  // InvalidArgument (a small block).
  Range* live_range(device_ptr ptr, const char* operation) const;
  // Returns a range node to the node pool (invalidating stale slot entries).
  void release_range(Range* r) noexcept;
  // An arena chunk without live blocks goes back to the range cache.
  void retire_arena_chunk(detail::ArenaChunk* chunk) noexcept;
  // Frees a reservation if nothing is mapped in it any more.
  void drop_reservation_if_empty(Reservation* reservation);
  device_ptr address_of(const Range* r) const noexcept {
    return r->reservation->base + r->first * chunk_size_;
  }
  [[noreturn]] void throw_invalid_pointer(device_ptr ptr, const char* operation) const;

  const std::size_t small_threshold_;
  const bool steal_before_create_;
  detail::SmallBlockArena arena_;
  detail::NodePool<Range> ranges_;
  detail::SizeBuckets<Range> cached_;
  std::map<device_ptr, std::unique_ptr<Reservation>> reservations_;
  // live_ (ChunkAllocatorCore) values: a Range* (chunk path) or ArenaBlock* | 1 (small path).
  detail::ArenaChunk* spare_ = nullptr;  // one empty arena chunk kept against churn
  std::size_t cached_chunks_ = 0;
  std::size_t live_chunks_ = 0;
  std::size_t live_ranges_ = 0;
  std::size_t live_blocks_ = 0;
  std::size_t unbacked_ranges_ = 0;
  std::size_t unbacked_chunks_ = 0;
  std::size_t unbacked_bytes_ = 0;
};

}  // namespace vmalloc
