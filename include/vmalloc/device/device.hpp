// The device interface: what the allocators and the swap manager need from a GPU, shaped
// after the CUDA driver's virtual memory management API (../shared/reference/cuda-vmm.md).
//
// Two implementations: HostDevice (host_device.hpp) emulates a GPU on host memory with the
// driver's rules; CudaDevice (cuda_device.hpp) calls the driver. Every method is thread-safe.
// Failures throw vmalloc::DeviceError (a driver call failed or a rule was broken; carries the
// CUresult code) or vmalloc::OutOfMemory (create beyond capacity); a failed call changes nothing.
#pragma once

#include <cstddef>
#include <string>

#include "vmalloc/base/driver_calls.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc {

class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "host:0", "cuda:0", ...
  virtual std::string name() const = 0;
  // The device ordinal (CUdevice number); 0 for a single emulated device.
  virtual int ordinal() const = 0;

  // CU_MEM_ALLOC_GRANULARITY_MINIMUM: sizes and addresses of create/map are multiples of it.
  virtual std::size_t granularity() const = 0;
  // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: a chunk size that performs best.
  virtual std::size_t recommended_granularity() const { return granularity(); }
  // Physical bytes the device can hold; 0 means unlimited.
  virtual std::size_t capacity() const = 0;
  // Physical bytes currently created and not yet freed (released allocations still mapped
  // count until their last mapping goes).
  virtual std::size_t physical_bytes_in_use() const = 0;
  // False for an accounting-only device whose memory cannot be read or written.
  virtual bool backed() const { return true; }

  // --- physical memory ---
  // cuMemCreate: pinned device memory of `size` bytes (a multiple of granularity()).
  virtual physical_handle create(std::size_t size) = 0;
  // cuMemRelease: legal while mapped; the memory goes when its last mapping does.
  virtual void release(physical_handle handle) = 0;

  // --- virtual address space ---
  // cuMemAddressReserve: `size` a multiple of granularity(), alignment 0 or a power of two.
  virtual device_ptr reserve(std::size_t size, std::size_t alignment) = 0;
  // cuMemAddressFree: exactly one whole reservation, fully unmapped.
  virtual void free_address(device_ptr ptr, std::size_t size) = 0;
  // cuMemMap with offset 0: all `size` bytes of `handle`'s allocation at `ptr`, onto reserved,
  // currently unmapped space inside one reservation. The mapping starts inaccessible.
  virtual void map(device_ptr ptr, std::size_t size, physical_handle handle) = 0;
  // map() of handles[mapped..n), each `size` bytes, back to back from `base` (chunk i at
  // base + i * size), counting `mapped` up as each succeeds, so that on a throw it says how
  // many are mapped. One call per chunk, counted as such; a device may do the run's
  // bookkeeping at once (HostDevice: one lock and one walk of its mappings for the run).
  virtual void map_chunks(device_ptr base, std::size_t size, const physical_handle* handles,
                          std::size_t n, std::size_t& mapped) {
    for (; mapped < n; ++mapped) map(base + mapped * size, size, handles[mapped]);
  }
  // cuMemUnmap: whole mappings only (one call may cover several adjacent ones).
  virtual void unmap(device_ptr ptr, std::size_t size) = 0;
  // cuMemSetAccess: read-write for this device over a fully mapped range (may span mappings).
  virtual void set_access(device_ptr ptr, std::size_t size) = 0;

  // --- pinned host memory (cuMemHostAlloc / cuMemFreeHost) ---
  virtual void* host_alloc(std::size_t size) = 0;
  virtual void host_free(void* ptr) = 0;

  // --- streams and events ---
  virtual stream_t create_stream() = 0;
  virtual void destroy_stream(stream_t stream) = 0;
  // Throws InvalidArgument naming `caller` when `stream` was destroyed on this device: every
  // allocator refuses to allocate or free on such a stream (one rule for all). The default
  // knows of no destroyed stream (a real driver's handle may be reused: not checkable).
  virtual void check_stream_alive(stream_t stream, const char* caller) const {
    (void)stream;
    (void)caller;
  }
  // Events are for synchronization only (CU_EVENT_DISABLE_TIMING).
  virtual event_t create_event() = 0;
  virtual void destroy_event(event_t event) = 0;
  // Captures the work queued on `stream` now.
  virtual void record_event(event_t event, stream_t stream) = 0;
  // True once the captured work has completed; an event never recorded is complete.
  virtual bool query_event(event_t event) = 0;
  virtual void synchronize_event(event_t event) = 0;
  // Work queued on `stream` after this waits for the event's captured work.
  virtual void wait_event(stream_t stream, event_t event) = 0;
  virtual void synchronize_stream(stream_t stream) = 0;
  // Waits for every stream.
  virtual void synchronize() = 0;

  // --- asynchronous copies, ordered on `stream` ---
  virtual void copy_to_device(device_ptr dst, const void* src, std::size_t nbytes,
                              stream_t stream) = 0;
  virtual void copy_to_host(void* dst, device_ptr src, std::size_t nbytes, stream_t stream) = 0;
  virtual void copy_device(device_ptr dst, device_ptr src, std::size_t nbytes,
                           stream_t stream) = 0;

  // --- checked mode: which bytes a program may touch ---
  // Allocators call these on every allocate and free (swap-outs and swap-ins of relocating
  // allocators go through both), so a device that checks (HostDevice(checked=true)) can make
  // freed and relocated memory fault. One inline branch when the device does not check; a
  // real GPU faults by itself and never turns it on. Never throw.
  void note_live(device_ptr ptr, std::size_t nbytes) noexcept {
    if (checks_liveness_) on_live(ptr, nbytes);
  }
  void note_freed(device_ptr ptr) noexcept {
    if (checks_liveness_) on_freed(ptr);
  }

  // --- accounting ---
  CounterSnapshot counters() const { return counters_.snapshot(); }
  void reset_counters() noexcept { counters_.reset(); }
  CostModel cost_model() const { return counters_.cost_model(); }
  void set_cost_model(const CostModel& model) { counters_.set_cost_model(model); }

 protected:
  // Set once in a checking device's constructor, before any allocator sees the device.
  bool checks_liveness_ = false;
  virtual void on_live(device_ptr ptr, std::size_t nbytes) noexcept {
    (void)ptr;
    (void)nbytes;
  }
  virtual void on_freed(device_ptr ptr) noexcept { (void)ptr; }

  // Implementations count every call they make, failed ones included.
  void count(DriverCall call) noexcept { counters_.count(call); }
  void count_copy(DriverCall call, std::size_t bytes) noexcept { counters_.count_copy(call, bytes); }

 private:
  DriverCounters counters_;
};

}  // namespace vmalloc
