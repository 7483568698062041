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
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/base/detail/allocation_counters.hpp"
#include "vmalloc/chunks/detail/chunk_range.hpp"
#include "vmalloc/base/detail/flat_ptr_map.hpp"
#include "vmalloc/base/detail/node_pool.hpp"
#include "vmalloc/base/detail/size_buckets.hpp"
#include "vmalloc/chunks/detail/small_block_arena.hpp"
#include "vmalloc/chunks/detail/stream_order.hpp"
#include "vmalloc/chunks/physical_chunk_pool.hpp"

namespace vmalloc {

struct VirtualAllocatorOptions {
  // Bytes per physical chunk; a positive multiple of the device granularity. 0 picks the
  // default: 2 MiB rounded up to a multiple of the granularity.
  std::size_t chunk_size = 0;
  // The most bytes of chunks held at once; 0 = no budget (the device's capacity limits).
  std::size_t budget = 0;
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

// Detail beyond Stats, in chunks (VirtualAllocator.chunk_stats() in Python).
struct ChunkStats {
  std::size_t chunk_size = 0;
  std::size_t small_threshold = 0;
  std::size_t budget_bytes = 0;
  std::size_t chunks_held = 0;         // live + cached + in_arenas + in_pool
  std::size_t peak_chunks_held = 0;
  std::size_t chunks_live = 0;         // mapped in live (chunk-path) allocations
  std::size_t chunks_cached = 0;       // mapped in cached ranges, reusable without driver calls
  std::size_t chunks_in_arenas = 0;    // mapped arena chunks (sub-allocated)
  std::size_t chunks_in_pool = 0;      // unmapped, in the pool's cache
  std::size_t free_chunks = 0;         // cached + in_pool + arena chunks without live blocks
  std::size_t arena_chunks_empty = 0;  // arena chunks without live blocks
  std::size_t cached_ranges = 0;
  std::size_t live_ranges = 0;
  std::size_t live_blocks = 0;         // live small (sub-allocated) allocations
  std::size_t free_blocks = 0;
  std::size_t arena_free_bytes = 0;
  std::size_t reservations = 0;
  std::size_t reserved_address_bytes = 0;
  std::size_t chunks_created = 0;      // since construction
  std::size_t chunks_released = 0;
  std::size_t chunks_stolen = 0;       // unmapped from cached ranges and remapped elsewhere
  // Live allocations whose chunks were unmapped (unmap_backing): their ranges stay reserved,
  // they count in Stats.live_allocations but not in requested/allocated bytes, and their
  // chunks are back in the pool (chunks_in_pool).
  std::size_t unbacked_ranges = 0;
  std::size_t chunks_unbacked = 0;     // chunk slots of those ranges, without chunks
  std::size_t unbacked_bytes = 0;      // the sizes asked for of those allocations
  std::size_t events_created = 0;
  bool multi_stream = false;
};

class VirtualAllocator final : public Allocator {
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
  Stats stats() const override;
  void reset_peak_stats() override;
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
  // Gathers k chunks into `chunks` (allocate's and map_backing's order: the pool's cache,
  // stealing first if steal_before_create, new chunks up to `creatable`, then stealing under
  // pressure). chunks[first_created, first_created + created) were created here (released,
  // not cached, on undo). Fewer than k only when the device refused chunks it reported free.
  void gather_chunks(std::size_t k, std::size_t creatable, std::vector<physical_handle>& chunks,
                     std::size_t& first_created, std::size_t& created);
  // Unmaps up to `need` chunks from cached ranges and empty arena chunks into `out`. With
  // `wait` false, only those whose frees' work is done (polled: no host wait) are taken.
  void steal(std::size_t need, std::vector<physical_handle>& out, bool wait);
  // Unmaps the last `take` chunks of a cached range whose work is done; handles into `out`.
  void unmap_tail(Range* range, std::size_t take, std::vector<physical_handle>& out);
  // Puts a free range into the cache, merging it with cached neighbours.
  void cache_range(Range* range) noexcept;
  // The live chunk-path range at ptr, for the swap primitives; throws InvalidPointer or
  // InvalidArgument (a small block).
  Range* live_range(device_ptr ptr, const char* operation) const;
  // Returns a range node to the node pool (invalidating stale slot entries).
  void release_range(Range* r) noexcept;
  // An arena chunk without live blocks goes back to the range cache.
  void retire_arena_chunk(detail::ArenaChunk* chunk) noexcept;
  // Frees a reservation if nothing is mapped in it any more.
  void drop_reservation_if_empty(Reservation* reservation);
  std::size_t chunks_for(std::size_t nbytes) const noexcept {
    return chunk_shift_ >= 0 ? (nbytes + chunk_size_ - 1) >> chunk_shift_
                             : (nbytes + chunk_size_ - 1) / chunk_size_;
  }
  device_ptr address_of(const Range* r) const noexcept {
    return r->reservation->base + r->first * chunk_size_;
  }
  std::size_t free_chunks() const noexcept;
  [[noreturn]] void throw_out_of_memory(std::size_t nbytes, const std::string& why);
  [[noreturn]] void throw_invalid_pointer(device_ptr ptr, const char* operation) const;
  std::size_t reserved_bytes() const noexcept { return pool_.chunks_held() * chunk_size_; }
  Stats stats_locked() const;

  const std::shared_ptr<Device> device_;
  const std::size_t chunk_size_;
  const int chunk_shift_;  // log2(chunk_size_) for a power of two, else -1: k without a divide
  const std::size_t small_threshold_;
  const bool steal_before_create_;
  mutable std::mutex mutex_;
  PhysicalChunkPool pool_;
  detail::StreamOrder order_;
  detail::SmallBlockArena arena_;
  detail::NodePool<Range> ranges_;
  detail::SizeBuckets<Range> cached_;
  std::map<device_ptr, std::unique_ptr<Reservation>> reservations_;
  // Live allocations by address: a Range* (chunk path) or ArenaBlock* | 1 (small path).
  detail::FlatPtrMap live_;
  detail::ArenaChunk* spare_ = nullptr;  // one empty arena chunk kept against churn
  std::size_t cached_chunks_ = 0;
  std::size_t live_chunks_ = 0;
  std::size_t live_ranges_ = 0;
  std::size_t live_blocks_ = 0;
  std::size_t stolen_ = 0;
  std::size_t unbacked_ranges_ = 0;
  std::size_t unbacked_chunks_ = 0;
  std::size_t unbacked_bytes_ = 0;
  detail::AllocationCounters counters_;  // Stats but reserved bytes (the pool's)
};

}  // namespace vmalloc
