// The allocator interface (like RMM's device_memory_resource): every vmalloc allocator, the
// replay engine and the C ABI speak it. Implementations are thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/stats.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc {

// Told of every free before an allocator makes it: the SwapManager, so that a free of an
// allocation it swapped out (the path every framework's free callback takes) drops its
// record and host copy at once. Implementations are thread-safe.
class FreeObserver {
 public:
  virtual ~FreeObserver() = default;
  // Called first by deallocate(ptr, nbytes, stream) (ptr != 0), no lock of the allocator
  // held. Returns true if the observer took the free over: nothing is left at `ptr` for the
  // allocator to free, and deallocate returns. A throw makes deallocate throw, nothing freed.
  virtual bool before_free(device_ptr ptr, std::size_t nbytes, stream_t stream) = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  Allocator() = default;
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Returns device memory of at least `nbytes`, usable at once by work on `stream`.
  // nbytes == 0 returns 0 (null) and counts nothing: the convention of PyTorch's and CuPy's
  // allocators. Throws OutOfMemory (state intact) or InvalidArgument (nbytes > max_request_bytes).
  virtual device_ptr allocate(std::size_t nbytes, stream_t stream) = 0;

  // Gives back an allocation. Work queued on `stream` before this call may still use it; the
  // memory is reusable at once on `stream` and by other streams once that work completes.
  // `nbytes` is the size asked for at allocate(), or unknown_size. ptr == 0 is a no-op.
  // Throws InvalidPointer for a pointer not live here, InvalidArgument when nbytes differs;
  // either way nothing changes.
  virtual void deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) = 0;

  // Returns cached (unused) physical memory to the device; the number of bytes given back.
  virtual std::size_t release_cached() = 0;

  virtual Stats stats() const = 0;
  // Sets every peak_* to its current value.
  virtual void reset_peak_stats() = 0;

  // The size asked for at allocate() of a live allocation; throws InvalidPointer otherwise.
  virtual std::size_t allocation_size(device_ptr ptr) const = 0;

  // Every live allocation as (address, size asked for), in no particular order. For the
  // SwapManager's swap_out_all. The default throws InvalidArgument (an allocator that cannot
  // list its allocations).
  virtual std::vector<std::pair<device_ptr, std::size_t>> live_allocations() const;

  // "virtual", "caching", ...
  virtual std::string name() const = 0;
  virtual const std::shared_ptr<Device>& device() const = 0;

  // Observers told of every deallocate of this allocator from now on (one that goes to its
  // upstream directly is not seen). Thread-safe; remove never throws.
  void add_free_observer(std::shared_ptr<FreeObserver> observer);
  void remove_free_observer(const FreeObserver* observer) noexcept;

 protected:
  // The first line of every deallocate: true when an observer took the free over. One
  // relaxed load when nothing observes.
  bool observe_free(device_ptr ptr, std::size_t nbytes, stream_t stream) {
    if (ptr == 0 || !observed_.load(std::memory_order_acquire)) return false;
    return notify_free(ptr, nbytes, stream);
  }

 private:
  bool notify_free(device_ptr ptr, std::size_t nbytes, stream_t stream);

  std::atomic<bool> observed_{false};
  std::mutex observers_mutex_;
  // Copied on write: a free reads a snapshot and calls the observers with no lock held.
  std::shared_ptr<const std::vector<std::shared_ptr<FreeObserver>>> observers_;
};

}  // namespace vmalloc
