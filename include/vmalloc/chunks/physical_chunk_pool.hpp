// PhysicalChunkPool: fixed-size physical chunks (cuMemCreate handles) and a cache of the
// unmapped ones.
//
// Every chunk is one physical allocation of exactly chunk_size bytes, so any chunk can back
// any chunk-sized slot of any reservation: physical memory never fragments, only the address
// space does, and address space is cheap. The pool creates chunks on demand within an optional
// budget, keeps unmapped chunks for reuse, and gives them back to the device on
// release_cached(). Thread-safe; the VirtualAllocator calls it only off its cache-hit path.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc {

// The most chunks one pool holds at once, whatever the device's capacity: every chunk costs
// bookkeeping in the pool, the allocator and the device (a few hundred bytes and a few
// microseconds), so a request for more (2 TiB of 2 MiB chunks; the largest GPUs hold under
// 2**18 such chunks) is refused at once with OutOfMemory instead of building gigabytes of
// books for minutes. Counted by creatable_chunks(), so allocators refuse before any work.
inline constexpr std::size_t max_pool_chunks = std::size_t{1} << 20;

struct ChunkPoolStats {
  std::size_t chunk_size = 0;
  std::size_t budget_bytes = 0;      // 0 = no budget (the device's capacity is the limit)
  std::size_t chunks_held = 0;       // created and not yet released (mapped or cached)
  std::size_t peak_chunks_held = 0;
  std::size_t chunks_cached = 0;     // held, unmapped, waiting in the pool
  std::size_t chunks_created = 0;    // cuMemCreate calls that succeeded, since construction
  std::size_t chunks_released = 0;   // cuMemRelease calls, since construction
};

class PhysicalChunkPool {
 public:
  // chunk_size: a positive multiple of device->granularity(); budget: the most bytes of
  // chunks held at once, 0 for none (else at least one chunk). Throws InvalidArgument.
  PhysicalChunkPool(std::shared_ptr<Device> device, std::size_t chunk_size,
                    std::size_t budget = 0);
  // Releases every chunk still held. A chunk still mapped somewhere is freed by the device
  // when its last mapping goes (cuMemRelease is legal while mapped).
  ~PhysicalChunkPool();
  PhysicalChunkPool(const PhysicalChunkPool&) = delete;
  PhysicalChunkPool& operator=(const PhysicalChunkPool&) = delete;

  // A chunk for the caller to map: a cached one if any, else a new one. Throws OutOfMemory
  // (budget reached, or the device is full) with nothing changed.
  physical_handle acquire();
  // A cached chunk, or 0 if the cache is empty. Never calls the device.
  physical_handle take_cached();
  // A new chunk from the device. Throws OutOfMemory with nothing changed.
  physical_handle create();
  // Returns an unmapped chunk to the cache. Throws InvalidArgument for a handle that is not
  // a chunk of this pool held by a caller.
  void give_back(physical_handle chunk);
  // give_back() of each of `chunks` in order, under one lock (a run of chunks unmapped at
  // once); a handle refused stops it there, those before it given back.
  void give_back(const std::vector<physical_handle>& chunks);
  // take_cached() until `out` holds `want` chunks or the cache is empty, under one lock;
  // `out` must have the capacity for them.
  void take_cached(std::vector<physical_handle>& out, std::size_t want);
  // Makes room in the cache for `more` chunks, so that as many give_back() calls that follow
  // cannot throw bad_alloc (a caller that must not fail after unmapping).
  void reserve_cache(std::size_t more);
  // Releases a chunk held by a caller (unmapped or not) to the device. Throws
  // InvalidArgument like give_back(), DeviceError from the device (then still held).
  void release(physical_handle chunk);
  // Releases every cached chunk to the device; returns the bytes released.
  std::size_t release_cached();

  // How many more chunks create() may succeed for: the budget's headroom, max_pool_chunks's,
  // and the device's when it has a capacity (an estimate: other users of the device may take
  // memory first).
  std::size_t creatable_chunks() const;

  std::size_t chunk_size() const noexcept { return chunk_size_; }
  std::size_t budget() const noexcept { return budget_; }
  const std::shared_ptr<Device>& device() const noexcept { return device_; }
  ChunkPoolStats stats() const;
  std::size_t chunks_held() const;
  std::size_t chunks_cached() const;

 private:
  physical_handle create_locked();

  const std::shared_ptr<Device> device_;
  const std::size_t chunk_size_;
  const std::size_t budget_;
  mutable std::mutex mutex_;
  std::vector<physical_handle> cached_;
  std::unordered_set<physical_handle> given_out_;
  std::size_t peak_held_ = 0;
  std::size_t created_ = 0;
  std::size_t released_ = 0;
};

}  // namespace vmalloc
