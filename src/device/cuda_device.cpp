#include "vmalloc/device/cuda_device.hpp"

#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc {

using namespace driver;

using detail::hex;

namespace {

std::string hex(const void* p) { return detail::hex(reinterpret_cast<std::uintptr_t>(p)); }

// The allocation properties of every cuMemCreate, and of the granularity query (the driver
// wants the same prop for both): pinned device memory on `ordinal`, not exportable.
CUmemAllocationProp allocation_prop(int ordinal) {
  CUmemAllocationProp prop{};  // zero: win32HandleMetaData, allocFlags
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  return prop;
}

CUstream as_stream(stream_t stream) { return reinterpret_cast<CUstream>(stream); }
CUevent as_event(event_t event) { return reinterpret_cast<CUevent>(event); }

}  // namespace

// Makes the device's primary context current on the calling thread for one scope: pushes it
// unless it already is current, and pops it again at the end.
class CudaDevice::ContextGuard {
 public:
  explicit ContextGuard(const CudaDevice& device) : device_(device) {
    CUcontext current = nullptr;
    device.check(device.api_->cuCtxGetCurrent(&current), "cuCtxGetCurrent", "cuCtxGetCurrent()");
    if (current != device.context_) {
      device.check(device.api_->cuCtxPushCurrent(device.context_), "cuCtxPushCurrent",
                   "cuCtxPushCurrent(primary context)");
      pushed_ = true;
    }
  }
  ~ContextGuard() {
    if (pushed_) {
      CUcontext popped = nullptr;
      device_.api_->cuCtxPopCurrent(&popped);  // cannot fail: we pushed it
    }
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const CudaDevice& device_;
  bool pushed_ = false;
};

CudaDevice::CudaDevice(int ordinal, const std::string& library)
    : api_(&load_driver(library.empty() ? default_driver_library() : library)),
      ordinal_(ordinal) {
  check(api_->cuInit(0), "cuInit", "cuInit(0)");
  check(api_->cuDriverGetVersion(&driver_version_), "cuDriverGetVersion", "cuDriverGetVersion()");
  check(api_->cuDeviceGet(&device_, ordinal),
        "cuDeviceGet", "cuDeviceGet(ordinal=" + std::to_string(ordinal) + ")");
  char device_name[256] = {};
  check(api_->cuDeviceGetName(device_name, sizeof device_name - 1, device_), "cuDeviceGetName",
        "cuDeviceGetName()");
  device_name_ = device_name;
  check(api_->cuDeviceTotalMem(&capacity_, device_), "cuDeviceTotalMem", "cuDeviceTotalMem()");
  check(api_->cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRetain()");
  try {
    ContextGuard guard(*this);
    const CUmemAllocationProp prop = allocation_prop(ordinal_);
    check(api_->cuMemGetAllocationGranularity(&granularity_, &prop,
                                              CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity(MINIMUM)");
    check(api_->cuMemGetAllocationGranularity(&recommended_granularity_, &prop,
                                              CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity(RECOMMENDED)");
    if (granularity_ == 0 || (granularity_ & (granularity_ - 1)) != 0)
      throw DeviceError(name() + ": the driver reports an allocation granularity of " +
                            std::to_string(granularity_) + " bytes, not a power of two",
                        "cuMemGetAllocationGranularity", CUDA_ERROR_UNKNOWN);
    if (recommended_granularity_ < granularity_ || recommended_granularity_ % granularity_ != 0)
      recommended_granularity_ = granularity_;
  } catch (...) {
    api_->cuDevicePrimaryCtxRelease(device_);
    throw;
  }
}

CudaDevice::~CudaDevice() {
  release_all();
  api_->cuDevicePrimaryCtxRelease(device_);
}

void CudaDevice::release_all() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (allocations_.empty() && mappings_.empty() && reservations_.empty() &&
      host_blocks_.empty() && streams_.empty() && events_.empty())
    return;
  try {
    ContextGuard guard(*this);
    // Queued work may still use what is freed below.
    api_->cuCtxSynchronize();
    for (event_t event : events_) api_->cuEventDestroy(as_event(event));
    for (stream_t stream : streams_) api_->cuStreamDestroy(as_stream(stream));
    for (const auto& [ptr, mapping] : mappings_) api_->cuMemUnmap(ptr, mapping.size);
    for (const auto& [handle, allocation] : allocations_)
      if (!allocation.released) api_->cuMemRelease(handle);
    for (const auto& [ptr, size] : reservations_) api_->cuMemAddressFree(ptr, size);
    for (const auto& [ptr, size] : host_blocks_) api_->cuMemFreeHost(ptr);
  } catch (...) {
    // No context could be made current: nothing can be freed; the driver frees it all when
    // the primary context goes.
  }
  events_.clear();
  streams_.clear();
  mappings_.clear();
  allocations_.clear();
  reservations_.clear();
  host_blocks_.clear();
  bytes_in_use_ = 0;
}

std::string CudaDevice::name() const { return "cuda:" + std::to_string(ordinal_); }

std::size_t CudaDevice::physical_bytes_in_use() const { return bytes_in_use_.load(); }

std::string CudaDevice::describe(CUresult result) const {
  // The driver emulator says which rule the call broke; read it before any other call.
  std::string detail;
  if (api_->emulator_last_error != nullptr) {
    char buffer[1024] = {};
    if (api_->emulator_last_error(buffer, sizeof buffer) > 0) detail = buffer;
  }
  const char* result_name = nullptr;
  const char* text = nullptr;
  std::string out;
  if (api_->cuGetErrorName(result, &result_name) == CUDA_SUCCESS && result_name != nullptr)
    out = result_name;
  else
    out = cu_result_name(result);
  if (api_->cuGetErrorString(result, &text) == CUDA_SUCCESS && text != nullptr)
    out += std::string(" (") + text + ")";
  if (!detail.empty()) {
    // Its message repeats "<symbol>: <CUresult name>: " first; keep only the reason.
    const std::string prefix_end = ": " + (result_name ? std::string(result_name)
                                                      : cu_result_name(result)) + ": ";
    const auto at = detail.find(prefix_end);
    if (at != std::string::npos) detail = detail.substr(at + prefix_end.size());
    out += " [driver emulator: " + detail + "]";
  }
  return out;
}

void CudaDevice::check(CUresult result, const char* entry_point, const std::string& what,
                       std::size_t requested) const {
  if (result == CUDA_SUCCESS) return;
  std::string message = what + " failed on " + name() + ": " + describe(result);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) {
    std::string state = name() + ": " + std::to_string(bytes_in_use_.load()) +
                        " bytes created by this device, capacity " + std::to_string(capacity_);
    throw OutOfMemory(message, requested, state);
  }
  throw DeviceError(message, entry_point, result);
}

// ---- physical memory ----

physical_handle CudaDevice::create(std::size_t size) {
  count(DriverCall::create);
  const CUmemAllocationProp prop = allocation_prop(ordinal_);
  std::lock_guard<std::mutex> lock(mutex_);
  allocations_.reserve(allocations_.size() + 1);  // the books cannot fail after the call
  ContextGuard guard(*this);
  CUmemGenericAllocationHandle handle = 0;
  check(api_->cuMemCreate(&handle, size, &prop, 0), "cuMemCreate",
        "cuMemCreate(size=" + std::to_string(size) + ")", size);
  allocations_[handle] = Allocation{size, 0, false};
  bytes_in_use_ += size;
  return handle;
}

void CudaDevice::release(physical_handle handle) {
  count(DriverCall::release);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocations_.find(handle);
  if (it == allocations_.end() || it->second.released)
    throw DeviceError("cuMemRelease(handle=" + std::to_string(handle) + ") on " + name() +
                          ": not a live physical allocation of this device (never created "
                          "here, or already released)",
                      "cuMemRelease", CUDA_ERROR_INVALID_VALUE);
  ContextGuard guard(*this);
  check(api_->cuMemRelease(handle), "cuMemRelease",
        "cuMemRelease(handle=" + std::to_string(handle) + ")");
  if (it->second.mappings == 0) {
    bytes_in_use_ -= it->second.size;
    allocations_.erase(it);
  } else {
    it->second.released = true;  // the memory goes with its last mapping
  }
}

// ---- virtual address space ----

device_ptr CudaDevice::reserve(std::size_t size, std::size_t alignment) {
  count(DriverCall::reserve);
  // Granularity-aligned reservations keep every mapped address aligned (NVIDIA's
  // vectorAddMMAP sample does the same); an invalid alignment goes to the driver to reject.
  const bool power_of_two = alignment != 0 && (alignment & (alignment - 1)) == 0;
  if (alignment == 0 || (power_of_two && alignment < granularity_)) alignment = granularity_;
  std::lock_guard<std::mutex> lock(mutex_);
  ContextGuard guard(*this);
  CUdeviceptr ptr = 0;
  check(api_->cuMemAddressReserve(&ptr, size, alignment, 0, 0), "cuMemAddressReserve",
        "cuMemAddressReserve(size=" + std::to_string(size) +
            ", alignment=" + std::to_string(alignment) + ")",
        size);
  try {
    reservations_[ptr] = size;
  } catch (...) {
    api_->cuMemAddressFree(ptr, size);
    throw;
  }
  return ptr;
}

void CudaDevice::free_address(device_ptr ptr, std::size_t size) {
  count(DriverCall::free_address);
  std::lock_guard<std::mutex> lock(mutex_);
  ContextGuard guard(*this);
  check(api_->cuMemAddressFree(ptr, size), "cuMemAddressFree",
        "cuMemAddressFree(ptr=" + hex(ptr) + ", size=" + std::to_string(size) + ")");
  auto it = reservations_.find(ptr);
  if (it != reservations_.end() && it->second == size) reservations_.erase(it);
}

void CudaDevice::map(device_ptr ptr, std::size_t size, physical_handle handle) {
  count(DriverCall::map);
  std::lock_guard<std::mutex> lock(mutex_);
  ContextGuard guard(*this);
  check(api_->cuMemMap(ptr, size, 0, handle, 0), "cuMemMap",
        "cuMemMap(ptr=" + hex(ptr) + ", size=" + std::to_string(size) +
            ", offset=0, handle=" + std::to_string(handle) + ")",
        size);
  try {
    mappings_[ptr] = Mapping{size, handle};
  } catch (...) {
    api_->cuMemUnmap(ptr, size);
    throw;
  }
  auto it = allocations_.find(handle);
  if (it != allocations_.end()) ++it->second.mappings;
}

void CudaDevice::unmap_locked(device_ptr ptr, std::size_t size) noexcept {
  auto it = mappings_.lower_bound(ptr);
  while (it != mappings_.end() && it->first < ptr + size) {
    auto allocation = allocations_.find(it->second.handle);
    if (allocation != allocations_.end() && --allocation->second.mappings == 0 &&
        allocation->second.released) {
      bytes_in_use_ -= allocation->second.size;
      allocations_.erase(allocation);
    }
    it = mappings_.erase(it);
  }
}

void CudaDevice::unmap(device_ptr ptr, std::size_t size) {
  count(DriverCall::unmap);
  std::lock_guard<std::mutex> lock(mutex_);
  ContextGuard guard(*this);
  check(api_->cuMemUnmap(ptr, size), "cuMemUnmap",
        "cuMemUnmap(ptr=" + hex(ptr) + ", size=" + std::to_string(size) + ")");
  unmap_locked(ptr, size);
}

void CudaDevice::set_access(device_ptr ptr, std::size_t size) {
  count(DriverCall::set_access);
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = ordinal_;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ContextGuard guard(*this);
  check(api_->cuMemSetAccess(ptr, size, &desc, 1), "cuMemSetAccess",
        "cuMemSetAccess(ptr=" + hex(ptr) + ", size=" + std::to_string(size) +
            ", read-write for device " + std::to_string(ordinal_) + ")");
}

// ---- pinned host memory ----

void* CudaDevice::host_alloc(std::size_t size) {
  count(DriverCall::host_alloc);
  std::lock_guard<std::mutex> lock(mutex_);
  host_blocks_.reserve(host_blocks_.size() + 1);
  ContextGuard guard(*this);
  void* ptr = nullptr;
  // PORTABLE: the swap manager may copy through it on any device's streams.
  check(api_->cuMemHostAlloc(&ptr, size, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc",
        "cuMemHostAlloc(size=" + std::to_string(size) + ", PORTABLE)", size);
  host_blocks_[ptr] = size;
  return ptr;
}

void CudaDevice::host_free(void* ptr) {
  count(DriverCall::host_free);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = host_blocks_.find(ptr);
  if (it == host_blocks_.end())
    throw DeviceError("cuMemFreeHost(ptr=" + hex(ptr) + ") on " + name() +
                          ": not pinned host memory allocated by this device",
                      "cuMemFreeHost", CUDA_ERROR_INVALID_VALUE);
  ContextGuard guard(*this);
  check(api_->cuMemFreeHost(ptr), "cuMemFreeHost", "cuMemFreeHost(ptr=" + hex(ptr) + ")");
  host_blocks_.erase(it);
}

// ---- streams and events ----

stream_t CudaDevice::create_stream() {
  count(DriverCall::stream_create);
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.reserve(streams_.size() + 1);
  ContextGuard guard(*this);
  CUstream stream = nullptr;
  // Non-blocking: no implicit synchronization with the legacy default stream, so ordering
  // is only what vmalloc asks for with events (as with PyTorch's and CuPy's streams).
  check(api_->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate",
        "cuStreamCreate(CU_STREAM_NON_BLOCKING)");
  auto handle = reinterpret_cast<stream_t>(stream);
  streams_.insert(handle);
  return handle;
}

void CudaDevice::destroy_stream(stream_t stream) {
  count(DriverCall::stream_destroy);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = streams_.find(stream);
  if (it == streams_.end())
    throw DeviceError("cuStreamDestroy(stream=" + hex(stream) + ") on " + name() +
                          ": not a stream created by this device (the default stream and "
                          "other libraries' streams are never destroyed here)",
                      "cuStreamDestroy", CUDA_ERROR_INVALID_HANDLE);
  ContextGuard guard(*this);
  check(api_->cuStreamDestroy(as_stream(stream)), "cuStreamDestroy",
        "cuStreamDestroy(stream=" + hex(stream) + ")");
  streams_.erase(it);
}

event_t CudaDevice::create_event() {
  count(DriverCall::event_create);
  std::lock_guard<std::mutex> lock(mutex_);
  events_.reserve(events_.size() + 1);
  ContextGuard guard(*this);
  CUevent event = nullptr;
  check(api_->cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate",
        "cuEventCreate(CU_EVENT_DISABLE_TIMING)");
  auto handle = reinterpret_cast<event_t>(event);
  events_.insert(handle);
  return handle;
}

void CudaDevice::destroy_event(event_t event) {
  count(DriverCall::event_destroy);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end())
    throw DeviceError("cuEventDestroy(event=" + hex(event) + ") on " + name() +
                          ": not an event created by this device",
                      "cuEventDestroy", CUDA_ERROR_INVALID_HANDLE);
  ContextGuard guard(*this);
  check(api_->cuEventDestroy(as_event(event)), "cuEventDestroy",
        "cuEventDestroy(event=" + hex(event) + ")");
  events_.erase(it);
}

void CudaDevice::record_event(event_t event, stream_t stream) {
  count(DriverCall::event_record);
  ContextGuard guard(*this);
  check(api_->cuEventRecord(as_event(event), as_stream(stream)), "cuEventRecord",
        "cuEventRecord(event=" + hex(event) + ", stream=" + hex(stream) + ")");
}

bool CudaDevice::query_event(event_t event) {
  count(DriverCall::event_query);
  ContextGuard guard(*this);
  const CUresult result = api_->cuEventQuery(as_event(event));
  if (result == CUDA_ERROR_NOT_READY) return false;
  check(result, "cuEventQuery", "cuEventQuery(event=" + hex(event) + ")");
  return true;
}

void CudaDevice::synchronize_event(event_t event) {
  count(DriverCall::event_synchronize);
  ContextGuard guard(*this);
  check(api_->cuEventSynchronize(as_event(event)), "cuEventSynchronize",
        "cuEventSynchronize(event=" + hex(event) + ")");
}

void CudaDevice::wait_event(stream_t stream, event_t event) {
  count(DriverCall::stream_wait_event);
  ContextGuard guard(*this);
  check(api_->cuStreamWaitEvent(as_stream(stream), as_event(event), 0), "cuStreamWaitEvent",
        "cuStreamWaitEvent(stream=" + hex(stream) + ", event=" + hex(event) + ")");
}

void CudaDevice::synchronize_stream(stream_t stream) {
  count(DriverCall::stream_synchronize);
  ContextGuard guard(*this);
  check(api_->cuStreamSynchronize(as_stream(stream)), "cuStreamSynchronize",
        "cuStreamSynchronize(stream=" + hex(stream) + ")");
}

void CudaDevice::synchronize() {
  count(DriverCall::synchronize);
  ContextGuard guard(*this);
  check(api_->cuCtxSynchronize(), "cuCtxSynchronize", "cuCtxSynchronize()");
}

// ---- asynchronous copies ----

void CudaDevice::copy_to_device(device_ptr dst, const void* src, std::size_t nbytes,
                                stream_t stream) {
  count_copy(DriverCall::copy_to_device, nbytes);
  ContextGuard guard(*this);
  check(api_->cuMemcpyHtoDAsync(dst, src, nbytes, as_stream(stream)), "cuMemcpyHtoDAsync",
        "cuMemcpyHtoDAsync(dst=" + hex(dst) + ", src=" + hex(src) +
            ", bytes=" + std::to_string(nbytes) + ", stream=" + hex(stream) + ")");
}

void CudaDevice::copy_to_host(void* dst, device_ptr src, std::size_t nbytes, stream_t stream) {
  count_copy(DriverCall::copy_to_host, nbytes);
  ContextGuard guard(*this);
  check(api_->cuMemcpyDtoHAsync(dst, src, nbytes, as_stream(stream)), "cuMemcpyDtoHAsync",
        "cuMemcpyDtoHAsync(dst=" + hex(dst) + ", src=" + hex(src) +
            ", bytes=" + std::to_string(nbytes) + ", stream=" + hex(stream) + ")");
}

void CudaDevice::copy_device(device_ptr dst, device_ptr src, std::size_t nbytes,
                             stream_t stream) {
  count_copy(DriverCall::copy_device, nbytes);
  ContextGuard guard(*this);
  check(api_->cuMemcpyDtoDAsync(dst, src, nbytes, as_stream(stream)), "cuMemcpyDtoDAsync",
        "cuMemcpyDtoDAsync(dst=" + hex(dst) + ", src=" + hex(src) +
            ", bytes=" + std::to_string(nbytes) + ", stream=" + hex(stream) + ")");
}

}  // namespace vmalloc
