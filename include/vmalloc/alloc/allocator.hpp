// The allocator interface (like RMM's device_memory_resource): every vmalloc allocator, the
// replay engine and the C ABI speak it. Implementations are thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/stats.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc {

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
};

}  // namespace vmalloc
