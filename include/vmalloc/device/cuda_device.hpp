// CudaDevice: the Device interface over the CUDA driver's virtual memory management API.
//
// The driver (libcuda.so.1, or $VMALLOC_LIBCUDA) is loaded with dlopen when a CudaDevice is
// constructed, so building vmalloc needs no CUDA toolkit and importing it touches no GPU. The
// device's primary context (the one CuPy and PyTorch use) is retained for the object's life and
// made current around every driver call, from whatever thread calls. Every failed call throws
// DeviceError naming the entry point and the CUresult (CUDA_ERROR_OUT_OF_MEMORY throws
// OutOfMemory instead), and changes nothing here.
//
// Streams and events are the driver's handles as integers, so CuPy's Stream.ptr and PyTorch's
// Stream.cuda_stream pass straight through. The device owns what it creates: handles,
// reservations, mappings, pinned host memory, streams and events still alive when it is
// destroyed are freed then (after a cuCtxSynchronize).
//
// Not checked here (the driver checks): the virtual memory rules. Checked here because the
// driver's behaviour is undefined for them: releasing a handle, freeing pinned memory or
// destroying a stream or event that this device did not create.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "vmalloc/device/detail/cuda_driver.hpp"
#include "vmalloc/device/device.hpp"

namespace vmalloc {

class CudaDevice : public Device {
 public:
  // Loads the driver (`library`, or default_driver_library() when empty), cuInit(0), retains
  // device `ordinal`'s primary context and queries granularity and capacity. Throws
  // DeviceError when the driver is missing or a call fails (CUDA_ERROR_INVALID_DEVICE for a
  // bad ordinal); nothing is left retained then.
  explicit CudaDevice(int ordinal = 0, const std::string& library = {});
  // Synchronizes, frees whatever this device still owns, releases the primary context.
  ~CudaDevice() override;

  std::string name() const override;
  int ordinal() const override { return ordinal_; }
  std::size_t granularity() const override { return granularity_; }
  std::size_t recommended_granularity() const override { return recommended_granularity_; }
  std::size_t capacity() const override { return capacity_; }
  std::size_t physical_bytes_in_use() const override;

  physical_handle create(std::size_t size) override;
  void release(physical_handle handle) override;
  device_ptr reserve(std::size_t size, std::size_t alignment) override;
  void free_address(device_ptr ptr, std::size_t size) override;
  void map(device_ptr ptr, std::size_t size, physical_handle handle) override;
  void unmap(device_ptr ptr, std::size_t size) override;
  void set_access(device_ptr ptr, std::size_t size) override;

  void* host_alloc(std::size_t size) override;
  void host_free(void* ptr) override;

  stream_t create_stream() override;
  void destroy_stream(stream_t stream) override;
  event_t create_event() override;
  void destroy_event(event_t event) override;
  void record_event(event_t event, stream_t stream) override;
  bool query_event(event_t event) override;
  void synchronize_event(event_t event) override;
  void wait_event(stream_t stream, event_t event) override;
  void synchronize_stream(stream_t stream) override;
  void synchronize() override;

  void copy_to_device(device_ptr dst, const void* src, std::size_t nbytes,
                      stream_t stream) override;
  void copy_to_host(void* dst, device_ptr src, std::size_t nbytes, stream_t stream) override;
  void copy_device(device_ptr dst, device_ptr src, std::size_t nbytes, stream_t stream) override;

  // The driver library this device runs on (a path or "libcuda.so.1").
  const std::string& library() const noexcept { return api_->path; }
  // cuDriverGetVersion: 12040 for CUDA 12.4.
  int driver_version() const noexcept { return driver_version_; }
  // cuDeviceGetName.
  const std::string& device_name() const noexcept { return device_name_; }
  // The CUcontext handle (the primary context), as an integer.
  std::uintptr_t context_handle() const noexcept {
    return reinterpret_cast<std::uintptr_t>(context_);
  }

 private:
  class ContextGuard;
  struct Allocation {
    std::size_t size = 0;
    std::size_t mappings = 0;  // live mappings of this handle
    bool released = false;     // cuMemRelease done; freed when the last mapping goes
  };
  struct Mapping {
    std::size_t size = 0;
    physical_handle handle = 0;
  };

  // Throws DeviceError (OutOfMemory for CUDA_ERROR_OUT_OF_MEMORY) unless result is success.
  // `what` is the call with its arguments, e.g. "cuMemMap(ptr=0x..., size=...)".
  void check(driver::CUresult result, const char* entry_point, const std::string& what,
             std::size_t requested = 0) const;
  std::string describe(driver::CUresult result) const;
  void unmap_locked(device_ptr ptr, std::size_t size) noexcept;  // mirror of a successful unmap
  void release_all() noexcept;                                   // destructor's cleanup

  const driver::DriverApi* api_;
  int ordinal_;
  driver::CUdevice device_ = 0;
  driver::CUcontext context_ = nullptr;
  std::size_t granularity_ = 0;
  std::size_t recommended_granularity_ = 0;
  std::size_t capacity_ = 0;
  int driver_version_ = 0;
  std::string device_name_;

  // What this device created and has not freed. The mutex is held across the driver call for
  // calls that change these books, so the books always match the driver's state.
  mutable std::mutex mutex_;
  std::unordered_map<physical_handle, Allocation> allocations_;
  std::map<device_ptr, Mapping> mappings_;          // by address
  std::map<device_ptr, std::size_t> reservations_;  // base -> size
  std::unordered_map<void*, std::size_t> host_blocks_;
  std::unordered_set<stream_t> streams_;
  std::unordered_set<event_t> events_;
  std::atomic<std::size_t> bytes_in_use_{0};  // read without the mutex by error paths
};

}  // namespace vmalloc
