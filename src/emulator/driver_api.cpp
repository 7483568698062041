// The driver's C entry points, exported under the names libcuda.so.1 exports (the versioned
// ones where cuda.h selects a version). Each one counts the call, applies injected faults,
// checks what the driver's C interface adds to the Device rules (NULL pointers, flags, the
// allocation properties, contexts, handles), routes to the emulated GPU's HostDevice, which
// enforces the virtual memory rules, and turns every exception into a CUresult: nothing ever
// propagates out of these functions.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <mutex>

#include "contexts.hpp"
#include "emulator.hpp"
#include "vmalloc/base/errors.hpp"

#define VMALLOC_EMULATOR_EXPORT extern "C" __attribute__((visibility("default")))

using namespace vmalloc;
using namespace vmalloc::driver;
using vmalloc::emulator::Emulator;
using vmalloc::emulator::EntryPoint;
using vmalloc::emulator::Failure;
using vmalloc::emulator::fail;
using vmalloc::emulator::Gpu;
using vmalloc::emulator::hex;

namespace {

using Lock = std::unique_lock<std::recursive_mutex>;

// Records what a call just created on the emulated GPU in the emulator's tables; if recording
// throws (the emulator is out of host memory), `give_back` undoes the creation, so a failed
// call leaks nothing. Returns what `record` returns (the new handle, for calls that make one).
template <class Record, class GiveBack>
auto record_or_give_back(Record&& record, GiveBack&& give_back) {
  try {
    return record();
  } catch (...) {
    give_back();
    throw;
  }
}

// Runs one entry point: count, fault injection, then `body(emulator)`, which returns the
// CUresult (CUDA_SUCCESS, or CUDA_ERROR_NOT_READY from cuEventQuery) or throws.
template <class Body>
CUresult run(EntryPoint entry, Body&& body) noexcept {
  Emulator* e = nullptr;
  // cuGetErrorName/String are called to describe a failure: they must not replace its message.
  const bool records = entry != EntryPoint::cuGetErrorName && entry != EntryPoint::cuGetErrorString;
  auto failed = [&](CUresult code, const std::string& message) noexcept {
    if (code == CUDA_SUCCESS) code = CUDA_ERROR_UNKNOWN;
    if (e != nullptr && records) e->record_error(emulator::entry_point_symbol(entry), code, message);
    return code;
  };
  try {
    e = &Emulator::instance();
    const std::uint64_t call = e->count(entry);
    if (const CUresult injected = e->faults().check(entry, call))
      return failed(injected, "injected fault: call " + std::to_string(call) + " of " +
                                  emulator::entry_point_symbol(entry) + " fails with " +
                                  cu_result_name(injected));
    return body(*e);
  } catch (const Failure& f) {
    return failed(f.code, f.message);
  } catch (const OutOfMemory& x) {
    return failed(CUDA_ERROR_OUT_OF_MEMORY, x.what());
  } catch (const DeviceError& x) {
    return failed(x.code(), x.what());
  } catch (const InvalidArgument& x) {
    return failed(CUDA_ERROR_INVALID_VALUE, x.what());
  } catch (const std::bad_alloc&) {
    return failed(CUDA_ERROR_OUT_OF_MEMORY, "the emulator ran out of host memory");
  } catch (const std::exception& x) {
    return failed(CUDA_ERROR_UNKNOWN, std::string("internal error: ") + x.what());
  } catch (...) {
    return failed(CUDA_ERROR_UNKNOWN, "internal error");
  }
}

void require(bool condition, const char* what) {
  if (!condition) fail(CUDA_ERROR_INVALID_VALUE, what);
}

std::string num(unsigned long long value) { return std::to_string(value); }

// The allocation properties vmalloc and NVIDIA's samples pass: pinned memory on a device,
// nothing exported, the rest zero. Returns the device they name.
Gpu& check_prop(Emulator& e, const CUmemAllocationProp* prop) {
  require(prop != nullptr, "prop is NULL");
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
    fail(CUDA_ERROR_INVALID_VALUE, "prop->type is " + num(prop->type) +
                                       ", must be CU_MEM_ALLOCATION_TYPE_PINNED (1)");
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    fail(CUDA_ERROR_INVALID_VALUE, "prop->location.type is " + num(prop->location.type) +
                                       ", must be CU_MEM_LOCATION_TYPE_DEVICE (1)");
  Gpu& gpu = e.gpu(prop->location.id);
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE)
    fail(CUDA_ERROR_NOT_SUPPORTED,
         "prop->requestedHandleTypes is " + num(prop->requestedHandleTypes) +
             ": exporting allocations to other processes is not emulated (pass 0)");
  if (prop->win32HandleMetaData != nullptr)
    fail(CUDA_ERROR_INVALID_VALUE,
         "prop->win32HandleMetaData must be NULL unless a Windows handle type is requested");
  if (prop->allocFlags.compressionType != 0 || prop->allocFlags.gpuDirectRDMACapable != 0 ||
      prop->allocFlags.usage != 0)
    fail(CUDA_ERROR_NOT_SUPPORTED,
         "prop->allocFlags (compression, GPUDirect RDMA, usage) are not emulated; leave them 0");
  for (unsigned char byte : prop->allocFlags.reserved)
    if (byte != 0) fail(CUDA_ERROR_INVALID_VALUE, "prop->allocFlags.reserved must be zero");
  return gpu;
}

void require_flags_zero(unsigned long long flags) {
  if (flags != 0)
    fail(CUDA_ERROR_INVALID_VALUE,
         "flags is " + num(flags) + ", must be 0 (reserved for future use)");
}

std::uintptr_t value_of(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace

// ===================== initialization, version, errors =====================

VMALLOC_EMULATOR_EXPORT CUresult cuInit(unsigned int flags) {
  return run(EntryPoint::cuInit, [&](Emulator& e) {
    e.init(flags);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuDriverGetVersion(int* version) {
  return run(EntryPoint::cuDriverGetVersion, [&](Emulator&) {
    require(version != nullptr, "driverVersion is NULL");
    *version = 12040;  // the CUDA 12.4 driver API: every entry point here exists in it
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuGetErrorName(CUresult error, const char** name) {
  return run(EntryPoint::cuGetErrorName, [&](Emulator&) {
    require(name != nullptr, "pStr is NULL");
    *name = cu_result_name_or_null(error);
    if (*name == nullptr)
      fail(CUDA_ERROR_INVALID_VALUE, "CUresult " + std::to_string(error) + " is not known");
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuGetErrorString(CUresult error, const char** text) {
  return run(EntryPoint::cuGetErrorString, [&](Emulator&) {
    require(text != nullptr, "pStr is NULL");
    *text = cu_result_description(error);
    if (*text == nullptr)
      fail(CUDA_ERROR_INVALID_VALUE, "CUresult " + std::to_string(error) + " is not known");
    return CUDA_SUCCESS;
  });
}

// ===================== symbol lookup (cuGetProcAddress) =====================

namespace {

// CUdriverProcAddressQueryResult and the cuGetProcAddress flags (cuda.h).
constexpr int CU_GET_PROC_ADDRESS_SUCCESS = 0;
constexpr int CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1;
constexpr int CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2;
constexpr unsigned long long CU_GET_PROC_ADDRESS_DEFAULT = 0;
constexpr unsigned long long CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1;
constexpr unsigned long long CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2;

// The CUDA version that introduced each versioned symbol the emulator exports: asked for an
// older version, the real driver returns the older variant, which the emulator does not have.
struct Introduced {
  const char* symbol;
  int version;
};
constexpr Introduced introduced[] = {
    {"cuDeviceTotalMem_v2", 3020},   {"cuMemcpyHtoDAsync_v2", 3020},
    {"cuMemcpyDtoHAsync_v2", 3020},  {"cuMemcpyDtoDAsync_v2", 3020},
    {"cuStreamDestroy_v2", 4000},    {"cuEventDestroy_v2", 4000},
    {"cuDevicePrimaryCtxRelease_v2", 11000}, {"cuGetProcAddress", 11030},
    {"cuGetProcAddress_v2", 12000},
};

// This library, for dlsym: the address handed out is the emulator's own export.
void* self_handle() {
  static void* handle = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&self_handle), &info) == 0 || info.dli_fname == nullptr)
      return static_cast<void*>(nullptr);
    return dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  }();
  return handle;
}

CUresult get_proc_address(const char* symbol, void** pfn, int cuda_version,
                          unsigned long long flags, int* status) {
  if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  require(symbol != nullptr, "symbol is NULL");
  require(pfn != nullptr, "pfn is NULL");
  *pfn = nullptr;
  if (cuda_version < 1000)
    fail(CUDA_ERROR_INVALID_VALUE,
         "cudaVersion " + std::to_string(cuda_version) + " is not a CUDA version (e.g. 12040)");
  if (flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
    fail(CUDA_ERROR_NOT_SUPPORTED,
         "CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: the per-thread default stream "
         "variants (_ptsz, _ptds) are not emulated");
  if (flags != CU_GET_PROC_ADDRESS_DEFAULT && flags != CU_GET_PROC_ADDRESS_LEGACY_STREAM)
    fail(CUDA_ERROR_INVALID_VALUE, "flags is " + num(flags) + ", not a CU_GET_PROC_ADDRESS_* flag");
  std::string name = symbol;
  // cuda.h 12.x maps cuGetProcAddress to cuGetProcAddress_v2.
  if (name == "cuGetProcAddress" && cuda_version >= 12000) name = "cuGetProcAddress_v2";
  EntryPoint entry{};
  if (!emulator::find_entry_point(name, &entry))
    fail(CUDA_ERROR_NOT_FOUND, "'" + std::string(symbol) +
                                   "' is not an entry point the driver emulator implements");
  const char* exported = emulator::entry_point_symbol(entry);
  for (const Introduced& i : introduced) {
    if (std::strcmp(i.symbol, exported) == 0 && cuda_version < i.version) {
      if (status != nullptr) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      fail(CUDA_ERROR_NOT_FOUND,
           "'" + std::string(symbol) + "' for CUDA " + std::to_string(cuda_version) +
               ": the emulator has only " + exported + " (CUDA " + std::to_string(i.version) +
               " and later)");
    }
  }
  void* address = self_handle() == nullptr ? nullptr : dlsym(self_handle(), exported);
  if (address == nullptr)
    fail(CUDA_ERROR_UNKNOWN, std::string("cannot resolve the emulator's own ") + exported);
  *pfn = address;
  if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

}  // namespace

VMALLOC_EMULATOR_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn,
                                                  int cudaVersion, unsigned long long flags) {
  return run(EntryPoint::cuGetProcAddress, [&](Emulator&) {
    return get_proc_address(symbol, pfn, cudaVersion, flags, nullptr);
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn,
                                                     int cudaVersion, unsigned long long flags,
                                                     int* symbolStatus) {
  return run(EntryPoint::cuGetProcAddress_v2, [&](Emulator&) {
    return get_proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
  });
}

// ===================== devices =====================

VMALLOC_EMULATOR_EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  return run(EntryPoint::cuDeviceGet, [&](Emulator& e) {
    e.require_initialized();
    require(device != nullptr, "device is NULL");
    Lock lock(e.mutex());
    *device = e.gpu(ordinal).ordinal;
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuDeviceGetCount(int* count) {
  return run(EntryPoint::cuDeviceGetCount, [&](Emulator& e) {
    e.require_initialized();
    require(count != nullptr, "count is NULL");
    *count = e.device_count();
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuDeviceGetName(char* name, int length, CUdevice device) {
  return run(EntryPoint::cuDeviceGetName, [&](Emulator& e) {
    e.require_initialized();
    require(name != nullptr, "name is NULL");
    require(length > 0, "len must be positive");
    Lock lock(e.mutex());
    std::snprintf(name, static_cast<std::size_t>(length), "vmalloc emulated GPU %d",
                  e.gpu(device).ordinal);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuDeviceTotalMem_v2(std::size_t* bytes, CUdevice device) {
  return run(EntryPoint::cuDeviceTotalMem, [&](Emulator& e) {
    e.require_initialized();
    require(bytes != nullptr, "bytes is NULL");
    Lock lock(e.mutex());
    *bytes = e.gpu(device).capacity;
    return CUDA_SUCCESS;
  });
}

// ===================== contexts =====================

VMALLOC_EMULATOR_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  return run(EntryPoint::cuDevicePrimaryCtxRetain, [&](Emulator& e) {
    e.require_initialized();
    require(context != nullptr, "pctx is NULL");
    e.retain_primary(context, device);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  return run(EntryPoint::cuDevicePrimaryCtxRelease, [&](Emulator& e) {
    e.require_initialized();
    e.release_primary(device);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuCtxGetCurrent(CUcontext* context) {
  return run(EntryPoint::cuCtxGetCurrent, [&](Emulator& e) {
    e.require_initialized();
    require(context != nullptr, "pctx is NULL");
    const auto& stack = emulator::context_stack();
    *context = stack.empty() ? nullptr : stack.back();
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuCtxSetCurrent(CUcontext context) {
  return run(EntryPoint::cuCtxSetCurrent, [&](Emulator& e) {
    e.require_initialized();
    auto& stack = emulator::context_stack();
    if (context == nullptr) {  // documented: pops the top, if any
      if (!stack.empty()) stack.pop_back();
      return CUDA_SUCCESS;
    }
    if (!e.known_context(context))
      fail(CUDA_ERROR_INVALID_CONTEXT, "context " + hex(value_of(context)) + " is not a context");
    if (stack.empty())
      stack.push_back(context);
    else
      stack.back() = context;
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext context) {
  return run(EntryPoint::cuCtxPushCurrent, [&](Emulator& e) {
    e.require_initialized();
    require(context != nullptr, "ctx is NULL");
    if (!e.known_context(context))
      fail(CUDA_ERROR_INVALID_CONTEXT, "context " + hex(value_of(context)) + " is not a context");
    emulator::context_stack().push_back(context);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* context) {
  return run(EntryPoint::cuCtxPopCurrent, [&](Emulator& e) {
    e.require_initialized();
    auto& stack = emulator::context_stack();
    if (stack.empty())
      fail(CUDA_ERROR_INVALID_CONTEXT, "no context is current on this thread: nothing to pop");
    if (context != nullptr) *context = stack.back();
    stack.pop_back();
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuCtxSynchronize() {
  return run(EntryPoint::cuCtxSynchronize, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    auto device = e.current_gpu().device;
    lock.unlock();  // never block other threads' calls while waiting
    device->synchronize();
    return CUDA_SUCCESS;
  });
}

// ===================== virtual memory management =====================

VMALLOC_EMULATOR_EXPORT CUresult cuMemGetAllocationGranularity(
    std::size_t* granularity, const CUmemAllocationProp* prop,
    CUmemAllocationGranularity_flags option) {
  return run(EntryPoint::cuMemGetAllocationGranularity, [&](Emulator& e) {
    e.require_initialized();
    require(granularity != nullptr, "granularity is NULL");
    Lock lock(e.mutex());
    e.current_gpu();
    Gpu& gpu = check_prop(e, prop);
    if (option == CU_MEM_ALLOC_GRANULARITY_MINIMUM)
      *granularity = gpu.device->granularity();
    else if (option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
      *granularity = gpu.device->recommended_granularity();
    else
      fail(CUDA_ERROR_INVALID_VALUE,
           "option is " + num(option) +
               ", must be CU_MEM_ALLOC_GRANULARITY_MINIMUM (0) or _RECOMMENDED (1)");
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle,
                                             std::size_t size, const CUmemAllocationProp* prop,
                                             unsigned long long flags) {
  return run(EntryPoint::cuMemCreate, [&](Emulator& e) {
    e.require_initialized();
    require(handle != nullptr, "handle is NULL");
    require_flags_zero(flags);
    Lock lock(e.mutex());
    e.current_gpu();
    Gpu& gpu = check_prop(e, prop);
    const physical_handle host = gpu.device->create(size);
    *handle = record_or_give_back(
        [&] {
          const CUmemGenericAllocationHandle h = e.next_allocation_handle();
          e.allocations().emplace(h, Emulator::Allocation{gpu.ordinal, host, size});
          return h;
        },
        [&] { gpu.device->release(host); });
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  return run(EntryPoint::cuMemRelease, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto it = e.allocations().find(handle);
    if (it == e.allocations().end() || it->second.released)
      fail(CUDA_ERROR_INVALID_VALUE,
           "handle " + num(handle) +
               " is not a live allocation: never created or already released (undefined "
               "behaviour on the real driver)");
    e.gpu(it->second.ordinal).device->release(it->second.host);
    if (it->second.mappings == 0)
      e.allocations().erase(it);
    else
      it->second.released = true;  // freed when its last mapping goes
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, std::size_t size,
                                                     std::size_t alignment, CUdeviceptr addr,
                                                     unsigned long long flags) {
  (void)addr;  // only a hint, documented as such: the emulator never honours it
  return run(EntryPoint::cuMemAddressReserve, [&](Emulator& e) {
    e.require_initialized();
    require(ptr != nullptr, "ptr is NULL");
    require_flags_zero(flags);
    Lock lock(e.mutex());
    Gpu& gpu = e.current_gpu();
    const device_ptr base = gpu.device->reserve(size, alignment);
    record_or_give_back(
        [&] { e.reservations().emplace(base, Emulator::Reservation{gpu.ordinal, size}); },
        [&] { gpu.device->free_address(base, size); });
    *ptr = base;
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, std::size_t size) {
  return run(EntryPoint::cuMemAddressFree, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto it = e.reservation_containing(ptr, "ptr");
    e.gpu(it->second.ordinal).device->free_address(ptr, size);
    e.reservations().erase(it);  // the device accepted: (ptr, size) was exactly this one
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemMap(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                                          CUmemGenericAllocationHandle handle,
                                          unsigned long long flags) {
  return run(EntryPoint::cuMemMap, [&](Emulator& e) {
    e.require_initialized();
    if (offset != 0)
      fail(CUDA_ERROR_INVALID_VALUE,
           "offset is " + num(offset) + ", must be 0 (the reference: \"currently must be zero\")");
    require_flags_zero(flags);
    Lock lock(e.mutex());
    e.current_gpu();
    auto allocation = e.allocations().find(handle);
    if (allocation == e.allocations().end() || allocation->second.released)
      fail(CUDA_ERROR_INVALID_VALUE, "handle " + num(handle) +
                                         " is not a live allocation (never created, or released)");
    auto reservation = e.reservation_containing(ptr, "ptr");
    if (reservation->second.ordinal != allocation->second.ordinal)
      fail(CUDA_ERROR_NOT_SUPPORTED,
           "mapping memory of device " + std::to_string(allocation->second.ordinal) +
               " into a range reserved on device " +
               std::to_string(reservation->second.ordinal) + " is not emulated");
    Gpu& gpu = e.gpu(allocation->second.ordinal);
    gpu.device->map(ptr, size, allocation->second.host);
    record_or_give_back([&] { e.mappings().emplace(ptr, Emulator::Mapping{size, handle}); },
                        [&] { gpu.device->unmap(ptr, size); });
    ++allocation->second.mappings;
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, std::size_t size) {
  return run(EntryPoint::cuMemUnmap, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto reservation = e.reservation_containing(ptr, "ptr");
    e.gpu(reservation->second.ordinal).device->unmap(ptr, size);
    // The device accepted: [ptr, ptr+size) is exactly a run of whole mappings.
    auto& mappings = e.mappings();
    for (auto it = mappings.lower_bound(ptr); it != mappings.end() && it->first < ptr + size;) {
      auto allocation = e.allocations().find(it->second.handle);
      if (allocation != e.allocations().end() && --allocation->second.mappings == 0 &&
          allocation->second.released)
        e.allocations().erase(allocation);
      it = mappings.erase(it);
    }
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, std::size_t size,
                                                const CUmemAccessDesc* desc, std::size_t count) {
  return run(EntryPoint::cuMemSetAccess, [&](Emulator& e) {
    e.require_initialized();
    require(desc != nullptr, "desc is NULL");
    require(count > 0, "count is 0: no access descriptor");
    Lock lock(e.mutex());
    e.current_gpu();
    auto reservation = e.reservation_containing(ptr, "ptr");
    for (std::size_t i = 0; i < count; ++i) {
      const CUmemAccessDesc& d = desc[i];
      const std::string which = "desc[" + std::to_string(i) + "]";
      if (d.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        fail(CUDA_ERROR_INVALID_VALUE, which + ".location.type is " + num(d.location.type) +
                                           ", must be CU_MEM_LOCATION_TYPE_DEVICE (1)");
      e.gpu(d.location.id);
      if (d.flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d.flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
          d.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        fail(CUDA_ERROR_INVALID_VALUE, which + ".flags is " + num(d.flags) +
                                           ", not a CUmemAccess_flags value (0, 1 or 3)");
      if (d.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        fail(CUDA_ERROR_NOT_SUPPORTED,
             which + ": only CU_MEM_ACCESS_FLAGS_PROT_READWRITE is emulated");
      if (d.location.id != reservation->second.ordinal)
        fail(CUDA_ERROR_NOT_SUPPORTED,
             which + ": access for device " + std::to_string(d.location.id) +
                 " to memory of device " + std::to_string(reservation->second.ordinal) +
                 " (peer access) is not emulated");
    }
    e.gpu(reservation->second.ordinal).device->set_access(ptr, size);
    return CUDA_SUCCESS;
  });
}

// ===================== pinned host memory =====================

VMALLOC_EMULATOR_EXPORT CUresult cuMemHostAlloc(void** ptr, std::size_t size, unsigned int flags) {
  return run(EntryPoint::cuMemHostAlloc, [&](Emulator& e) {
    e.require_initialized();
    require(ptr != nullptr, "pp is NULL");
    require(size > 0, "bytesize is 0");
    if ((flags & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                   CU_MEMHOSTALLOC_WRITECOMBINED)) != 0)
      fail(CUDA_ERROR_INVALID_VALUE,
           "Flags is " + num(flags) + ": only PORTABLE (1), DEVICEMAP (2), WRITECOMBINED (4)");
    Lock lock(e.mutex());
    Gpu& gpu = e.current_gpu();
    void* block = gpu.device->host_alloc(size);
    record_or_give_back(
        [&] { e.host_blocks().emplace(block, Emulator::HostBlock{gpu.ordinal, size}); },
        [&] { gpu.device->host_free(block); });
    *ptr = block;
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemFreeHost(void* ptr) {
  return run(EntryPoint::cuMemFreeHost, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto it = e.host_blocks().find(ptr);
    if (it == e.host_blocks().end())
      fail(CUDA_ERROR_INVALID_VALUE,
           "p " + hex(value_of(ptr)) + " is not pinned memory from cuMemHostAlloc (or was freed)");
    e.gpu(it->second.ordinal).device->host_free(ptr);
    e.host_blocks().erase(it);
    return CUDA_SUCCESS;
  });
}

// ===================== streams =====================

VMALLOC_EMULATOR_EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  return run(EntryPoint::cuStreamCreate, [&](Emulator& e) {
    e.require_initialized();
    require(stream != nullptr, "phStream is NULL");
    if ((flags & ~CU_STREAM_NON_BLOCKING) != 0)
      fail(CUDA_ERROR_INVALID_VALUE, "Flags is " + num(flags) +
                                         ": only CU_STREAM_DEFAULT (0) or NON_BLOCKING (1)");
    Lock lock(e.mutex());
    Gpu& gpu = e.current_gpu();
    const stream_t host = gpu.device->create_stream((flags & CU_STREAM_NON_BLOCKING) != 0);
    const std::uintptr_t handle = record_or_give_back(
        [&] {
          const std::uintptr_t h = e.next_stream_handle();
          e.streams().emplace(h, Emulator::Stream{gpu.ordinal, host, flags});
          return h;
        },
        [&] { gpu.device->destroy_stream(host); });
    *stream = reinterpret_cast<CUstream>(handle);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
  return run(EntryPoint::cuStreamDestroy, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    const std::uintptr_t value = value_of(stream);
    if (value == 0 || value == CU_STREAM_LEGACY || value == CU_STREAM_PER_THREAD)
      fail(CUDA_ERROR_INVALID_HANDLE, "the default stream cannot be destroyed");
    e.check_not_destroyed_stream(value, "cuStreamDestroy");
    auto it = e.streams().find(value);
    if (it == e.streams().end())
      fail(CUDA_ERROR_INVALID_HANDLE,
           "stream " + hex(value) + " is not a live stream (never created, or destroyed)");
    e.gpu(it->second.ordinal).device->destroy_stream(it->second.host);
    const int ordinal = it->second.ordinal;
    e.streams().erase(it);
    try {
      e.note_destroyed_stream(value, ordinal);
    } catch (...) {
    }
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuStreamSynchronize(CUstream stream) {
  return run(EntryPoint::cuStreamSynchronize, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto [gpu, host] = e.resolve_stream(stream);
    auto device = gpu->device;
    lock.unlock();
    device->synchronize_stream(host);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event,
                                                   unsigned int flags) {
  return run(EntryPoint::cuStreamWaitEvent, [&](Emulator& e) {
    e.require_initialized();
    if (flags != 0)
      fail(CUDA_ERROR_INVALID_VALUE, "Flags is " + num(flags) + ", must be 0 (CU_EVENT_WAIT_DEFAULT)");
    Lock lock(e.mutex());
    e.current_gpu();
    auto [gpu, host] = e.resolve_stream(stream);
    const Emulator::Event ev = e.resolve_event(event);
    if (ev.ordinal == gpu->ordinal) {
      gpu->device->wait_event(host, ev.host);
    } else {
      // Another device's event: the driver allows it; the emulator waits on the host, which
      // orders at least as strongly.
      auto other = e.gpu(ev.ordinal).device;
      lock.unlock();
      other->synchronize_event(ev.host);
    }
    return CUDA_SUCCESS;
  });
}

// ===================== events =====================

VMALLOC_EMULATOR_EXPORT CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  return run(EntryPoint::cuEventCreate, [&](Emulator& e) {
    e.require_initialized();
    require(event != nullptr, "phEvent is NULL");
    if ((flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)) != 0)
      fail(CUDA_ERROR_INVALID_VALUE, "Flags is " + num(flags) + ", not a CUevent_flags mask");
    if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0)
      fail(CUDA_ERROR_INVALID_VALUE, "CU_EVENT_INTERPROCESS requires CU_EVENT_DISABLE_TIMING");
    if ((flags & CU_EVENT_INTERPROCESS) != 0)
      fail(CUDA_ERROR_NOT_SUPPORTED, "interprocess events are not emulated");
    Lock lock(e.mutex());
    Gpu& gpu = e.current_gpu();
    const event_t host = gpu.device->create_event();
    const std::uintptr_t handle = record_or_give_back(
        [&] {
          const std::uintptr_t h = e.next_event_handle();
          e.events().emplace(h, Emulator::Event{gpu.ordinal, host});
          return h;
        },
        [&] { gpu.device->destroy_event(host); });
    *event = reinterpret_cast<CUevent>(handle);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuEventDestroy_v2(CUevent event) {
  return run(EntryPoint::cuEventDestroy, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    const Emulator::Event ev = e.resolve_event(event);
    e.gpu(ev.ordinal).device->destroy_event(ev.host);
    e.events().erase(value_of(event));
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
  return run(EntryPoint::cuEventRecord, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    const Emulator::Event ev = e.resolve_event(event);
    auto [gpu, host] = e.resolve_stream(stream);
    if (ev.ordinal != gpu->ordinal)
      fail(CUDA_ERROR_INVALID_HANDLE, "event of device " + std::to_string(ev.ordinal) +
                                          " recorded on a stream of device " +
                                          std::to_string(gpu->ordinal) +
                                          " (they must share a context)");
    gpu->device->record_event(ev.host, host);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuEventQuery(CUevent event) {
  return run(EntryPoint::cuEventQuery, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    const Emulator::Event ev = e.resolve_event(event);
    auto device = e.gpu(ev.ordinal).device;
    lock.unlock();
    return device->query_event(ev.host) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuEventSynchronize(CUevent event) {
  return run(EntryPoint::cuEventSynchronize, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    const Emulator::Event ev = e.resolve_event(event);
    auto device = e.gpu(ev.ordinal).device;
    lock.unlock();
    device->synchronize_event(ev.host);
    return CUDA_SUCCESS;
  });
}

// ===================== asynchronous copies =====================

namespace {

// The device memory at `ptr` must be on the stream's device.
void same_device(Emulator& e, CUdeviceptr ptr, const char* what, const Gpu& stream_gpu) {
  auto reservation = e.reservation_containing(ptr, what);
  if (reservation->second.ordinal != stream_gpu.ordinal)
    fail(CUDA_ERROR_NOT_SUPPORTED,
         std::string(what) + " " + hex(ptr) + " is memory of device " +
             std::to_string(reservation->second.ordinal) + ", the stream belongs to device " +
             std::to_string(stream_gpu.ordinal) + ": copies across devices are not emulated");
}

}  // namespace

VMALLOC_EMULATOR_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src,
                                                      std::size_t bytes, CUstream stream) {
  return run(EntryPoint::cuMemcpyHtoDAsync, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto [gpu, host] = e.resolve_stream(stream);
    if (bytes == 0) return CUDA_SUCCESS;
    require(src != nullptr, "srcHost is NULL");
    same_device(e, dst, "dstDevice", *gpu);
    auto device = gpu->device;
    lock.unlock();
    device->copy_to_device(dst, src, bytes, host);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src,
                                                      std::size_t bytes, CUstream stream) {
  return run(EntryPoint::cuMemcpyDtoHAsync, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto [gpu, host] = e.resolve_stream(stream);
    if (bytes == 0) return CUDA_SUCCESS;
    require(dst != nullptr, "dstHost is NULL");
    same_device(e, src, "srcDevice", *gpu);
    auto device = gpu->device;
    lock.unlock();
    device->copy_to_host(dst, src, bytes, host);
    return CUDA_SUCCESS;
  });
}

VMALLOC_EMULATOR_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src,
                                                      std::size_t bytes, CUstream stream) {
  return run(EntryPoint::cuMemcpyDtoDAsync, [&](Emulator& e) {
    e.require_initialized();
    Lock lock(e.mutex());
    e.current_gpu();
    auto [gpu, host] = e.resolve_stream(stream);
    if (bytes == 0) return CUDA_SUCCESS;
    same_device(e, dst, "dstDevice", *gpu);
    same_device(e, src, "srcDevice", *gpu);
    auto device = gpu->device;
    lock.unlock();
    device->copy_device(dst, src, bytes, host);
    return CUDA_SUCCESS;
  });
}
