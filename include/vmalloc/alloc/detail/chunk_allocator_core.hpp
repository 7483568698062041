// ChunkAllocatorCore: what the two virtual allocators (VirtualAllocator: chunk placement,
// PackedVirtualAllocator: packed placement) share, written once.
//
// The state: the device, the chunk size, the physical chunk pool, the stream order, the live
// allocations by address, the Stats counters and the mutex. The steps: the checks before the
// lock of allocate() and deallocate(), the "enough chunks?" decision, out-of-memory and
// invalid-pointer errors in one format, Stats and the common part of the chunk stats. Gathering
// chunks with an undo is ChunkBatch (chunk_batch.hpp).
//
// Each allocator inherits it privately; its members run with mutex_ held unless they say so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/alloc/chunk_options.hpp"
#include "vmalloc/alloc/chunk_stats.hpp"
#include "vmalloc/base/detail/allocation_counters.hpp"
#include "vmalloc/base/detail/flat_ptr_map.hpp"
#include "vmalloc/base/errors.hpp"
#include "vmalloc/base/types.hpp"
#include "vmalloc/chunks/detail/reservation_teardown.hpp"
#include "vmalloc/chunks/detail/stream_order.hpp"
#include "vmalloc/chunks/physical_chunk_pool.hpp"
#include "vmalloc/device/device.hpp"

namespace vmalloc::detail {

class ChunkAllocatorCore {
 protected:
  // `owner` names the allocator in messages; the chunk size must also be a multiple of
  // `placement_unit`. `chunk_counts_are_bounds`: a request may need fewer new chunks than it
  // spans (packed placement shares slots), which out-of-memory messages say. Throws
  // InvalidArgument for a null device, a bad chunk size or budget.
  ChunkAllocatorCore(const char* owner, std::shared_ptr<Device> device,
                     const ChunkOptions& options, std::size_t placement_unit,
                     bool chunk_counts_are_bounds);
  ~ChunkAllocatorCore() = default;
  ChunkAllocatorCore(const ChunkAllocatorCore&) = delete;
  ChunkAllocatorCore& operator=(const ChunkAllocatorCore&) = delete;

  // allocate()'s checks, before taking the lock: the stream must be alive (it becomes its
  // stream key), a request over max_request_bytes throws InvalidArgument. False for 0 bytes:
  // null is returned and nothing counted (PyTorch's and CuPy's convention).
  bool admit_allocation(std::size_t nbytes, stream_t& stream) const {
    device_->check_stream_alive(stream, allocate_caller_.c_str());
    stream = stream_key(stream);  // CU_STREAM_PER_THREAD: one stream per thread
    if (nbytes == 0) return false;
    if (nbytes > max_request_bytes) throw_request_too_large(nbytes);
    return true;
  }
  // deallocate()'s, before the lock: the stream must be alive; false for a null pointer.
  bool admit_free(device_ptr ptr, stream_t& stream) const {
    device_->check_stream_alive(stream, deallocate_caller_.c_str());
    stream = stream_key(stream);
    return ptr != 0;
  }
  // Throws InvalidArgument when deallocate()'s `nbytes` is known and not the size asked for.
  void check_free_size(std::size_t nbytes, std::size_t requested, device_ptr ptr) const {
    if (nbytes != unknown_size && nbytes != requested) throw_size_mismatch(nbytes, requested, ptr);
  }

  // Enough chunks? Whether `need` chunks can be had from the pool's cache, `stealable` free
  // mapped chunks of the allocator and new ones (within budget and capacity), whatever the
  // address space looks like. Decided before any driver call, so a refusal changes nothing.
  bool chunks_available(std::size_t need, std::size_t stealable) const;
  // Throws OutOfMemory for a request of `nbytes` unless chunks_available(need, stealable);
  // `backing`: the address being backed again (map_backing), named in the message.
  void require_chunks(std::size_t need, std::size_t stealable, std::size_t nbytes,
                      device_ptr backing = 0) const;
  // OutOfMemory for a request of `nbytes`, `why`, with the allocator's Stats summary. Not
  // counted here: counting_out_of_memory() counts it on the way out.
  [[noreturn]] void throw_out_of_memory(std::size_t nbytes, const std::string& why) const;
  // Runs a public entry point's placement, counting in Stats.out_of_memory_count an
  // OutOfMemory it raises once, whoever raised it (the allocator or the device).
  template <class Step>
  auto counting_out_of_memory(Step&& step) -> decltype(step()) {
    try {
      return step();
    } catch (const OutOfMemory&) {
      counters_.count_out_of_memory();
      throw;
    }
  }

  // InvalidPointer for `ptr` given to `operation`. `explain(res, offset)` says what byte
  // `offset` of the reservation `res` holding `ptr` is (reservations: a map by base address
  // to pointers to reservations with base and slots); a pointer outside every reservation is
  // "not allocated by this allocator".
  template <class Reservations, class Explain>
  [[noreturn]] void throw_invalid_pointer(device_ptr ptr, const char* operation,
                                          const Reservations& reservations,
                                          Explain&& explain) const {
    auto it = reservations.upper_bound(ptr);
    if (ptr != 0 && it != reservations.begin()) {
      const auto& res = *std::prev(it)->second;
      if (ptr < res.base + res.slots * chunk_size_)
        throw_invalid_pointer(ptr, operation, explain(res, ptr - res.base));
    }
    throw_invalid_pointer(ptr, operation, "not allocated by this allocator");
  }
  [[noreturn]] void throw_invalid_pointer(device_ptr ptr, const char* operation,
                                          const std::string& why) const;
  // What throw_invalid_pointer's `explain` says of a pointer into a live allocation, or into
  // free memory.
  static std::string interior_pointer(device_ptr ptr, device_ptr allocation,
                                      std::size_t requested);
  static const char* const freed_memory;

  // Every live allocation as (address, size asked for); `requested(value)` reads the size
  // from a live_ value. Takes the lock.
  template <class Requested>
  std::vector<std::pair<device_ptr, std::size_t>> list_live(Requested&& requested) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<device_ptr, std::size_t>> out;
    out.reserve(live_.size());
    live_.for_each(
        [&](std::uintptr_t key, std::uintptr_t value) { out.emplace_back(key, requested(value)); });
    return out;
  }

  // For the allocators' destructors: takes the lock, waits for the device, unmaps every
  // mapped run of `reservations` (a map to pointers to reservations) and frees their address
  // space. The pool's destructor then releases every chunk, the stream order's the events.
  template <class Reservations>
  void tear_down(const Reservations& reservations) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    tear_down_reservations(*device_, reservations, chunk_size_);
  }

  // Stats with the reserved bytes the pool holds. current_stats() and reset_peaks() take
  // the lock (the allocators' stats() and reset_peak_stats()).
  Stats stats_locked() const { return counters_.snapshot(reserved_bytes()); }
  Stats current_stats() const;
  void reset_peaks();
  std::size_t reserved_bytes() const { return pool_.chunks_held() * chunk_size_; }
  // The fields of the chunk stats every placement fills alike: from the pool, the stream
  // order and `reservations` (a map to pointers to reservations with slots).
  template <class Reservations>
  void fill_common_stats(CommonChunkStats& s, std::size_t small_threshold,
                         const Reservations& reservations) const {
    fill_pool_stats(s, small_threshold);
    s.reservations = reservations.size();
    for (const auto& e : reservations) s.reserved_address_bytes += e.second->slots * chunk_size_;
  }

  // Chunks spanned by `bytes` from a chunk boundary (rounded up), and the slot holding byte
  // `offset` of a reservation: a shift for a power-of-two chunk size (the usual case: a
  // 64-bit division costs tens of cycles, several per cache hit).
  std::size_t chunks_for(std::size_t bytes) const noexcept {
    return chunk_shift_ >= 0 ? (bytes + chunk_size_ - 1) >> chunk_shift_
                             : (bytes + chunk_size_ - 1) / chunk_size_;
  }
  std::size_t slot_of(std::size_t offset) const noexcept {
    return chunk_shift_ >= 0 ? offset >> chunk_shift_ : offset / chunk_size_;
  }

  const std::string owner_;
  const std::shared_ptr<Device> device_;
  const std::size_t chunk_size_;
  const int chunk_shift_;  // log2(chunk_size_) for a power of two, else -1
  mutable std::mutex mutex_;
  PhysicalChunkPool pool_;
  StreamOrder order_;
  FlatPtrMap live_;                // live allocations by address (values: the allocator's)
  AllocationCounters counters_;    // Stats but reserved bytes (the pool's)
  std::size_t stolen_ = 0;         // chunks unmapped from free mapped memory, remapped

 private:
  void fill_pool_stats(CommonChunkStats& s, std::size_t small_threshold) const;
  [[noreturn]] void throw_request_too_large(std::size_t nbytes) const;
  [[noreturn]] void throw_size_mismatch(std::size_t nbytes, std::size_t requested,
                                        device_ptr ptr) const;

  const bool chunk_counts_are_bounds_;
  // check_stream_alive's caller names, built once: the hit path builds no string.
  const std::string allocate_caller_;
  const std::string deallocate_caller_;
};

}  // namespace vmalloc::detail
