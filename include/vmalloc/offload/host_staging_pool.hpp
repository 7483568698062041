// HostStagingPool: a caching allocator of pinned host memory (Device::host_alloc/host_free),
// where the SwapManager keeps the data of swapped-out allocations.
//
// cuMemHostAlloc is slow (it pins pages), so freed blocks are cached by size class and reused.
// Size classes: a request rounds up to a power of two up to 2 MiB (at least 4 KiB), above
// that to a multiple of 2 MiB. A request takes the smallest cached block of its class up to
// twice it (best fit), so blocks serve the next iteration's slightly different sizes too; the
// waste stays below half. An optional capacity bounds the pinned host
// memory held (in use + cached): over it, cached blocks are freed first, then
// HostOutOfMemory is raised. Thread-safe. Every block is freed by the destructor (RAII).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc {

// The pinned host memory the SwapManager may use is exhausted (its host_capacity). An
// OutOfMemory, so that Python raises vmalloc.OutOfMemoryError; the message says "host".
class HostOutOfMemory : public OutOfMemory {
 public:
  using OutOfMemory::OutOfMemory;
};

struct HostStagingStats {
  std::size_t capacity_bytes = 0;     // 0 = no capacity
  std::size_t in_use_bytes = 0;       // class bytes of blocks handed out
  std::size_t peak_in_use_bytes = 0;
  std::size_t cached_bytes = 0;       // freed blocks kept for reuse
  std::size_t blocks_in_use = 0;
  std::size_t blocks_cached = 0;
  std::size_t host_alloc_calls = 0;   // successful cuMemHostAlloc calls
  std::size_t host_free_calls = 0;
  std::size_t reuses = 0;             // requests served from the cache
};

class HostStagingPool {
 public:
  // capacity: the most bytes of pinned host memory held at once, 0 for no limit.
  explicit HostStagingPool(std::shared_ptr<Device> device, std::size_t capacity = 0);
  ~HostStagingPool();  // frees every block, in use or cached (errors swallowed)
  HostStagingPool(const HostStagingPool&) = delete;
  HostStagingPool& operator=(const HostStagingPool&) = delete;

  // The size class of a request: what a block serving it holds.
  static std::size_t size_class(std::size_t nbytes) noexcept;

  // A block of at least `nbytes` (> 0). Throws HostOutOfMemory (over the capacity, after
  // freeing the cache), DeviceError / OutOfMemory from host_alloc; nothing changes then.
  void* allocate(std::size_t nbytes);
  // Throws HostOutOfMemory if allocate(nbytes) would exceed the capacity even after freeing
  // the cache; changes nothing (lets a caller fail before any driver call).
  void check_capacity(std::size_t nbytes) const;
  // Returns a block to the cache. Throws InvalidArgument for a pointer not handed out here.
  void deallocate(void* ptr);
  // Frees every cached block; returns the bytes freed.
  std::size_t release_cached();

  HostStagingStats stats() const;
  std::size_t capacity() const noexcept { return capacity_; }

 private:
  std::size_t release_cached_locked() noexcept;
  // The cached block a request of class `c` takes: the smallest of at least `c` and at most
  // `2c`; cached_.end() if none.
  std::multimap<std::size_t, void*>::const_iterator reusable(std::size_t c) const;
  [[noreturn]] void throw_over_capacity(std::size_t nbytes) const;

  const std::shared_ptr<Device> device_;
  const std::size_t capacity_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> cached_;        // class -> block
  std::unordered_map<void*, std::size_t> in_use_;   // block -> class
  HostStagingStats stats_;
};

}  // namespace vmalloc
