// The slice of the CUDA driver API that vmalloc uses, declared by hand from NVIDIA's driver API
// reference (docs.nvidia.com/cuda/cuda-driver-api, "Data types used by CUDA driver" and the
// "Virtual Memory Management" group), so that building vmalloc needs no CUDA toolkit.
//
// Used twice: CudaDevice resolves these entry points from libcuda.so.1 at run time, and the
// driver emulator (src/emulator/) exports them with exactly these C signatures. The layouts
// are pinned by static_asserts below; the symbol names are the ones cuda.h's #defines select
// (cuda.h maps e.g. cuMemcpyHtoDAsync to cuMemcpyHtoDAsync_v2; calling the unversioned legacy
// symbol would use the CUDA 3.1 ABI with 32-bit device pointers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vmalloc::driver {

// ---- scalar and handle types (cuda.h, 64-bit platforms) ----
using CUresult = int;                                  // enum cudaError_enum
using CUdevice = int;
using CUdeviceptr = unsigned long long;                // CUdeviceptr_v2
using CUmemGenericAllocationHandle = unsigned long long;
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;

// ---- CUresult values (enum cudaError_enum) ----
enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_UNKNOWN = 999,
};

// ---- virtual memory management types ----
enum CUmemAllocationType : int {
  CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
  CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
};
enum CUmemAllocationHandleType : int {
  CU_MEM_HANDLE_TYPE_NONE = 0x0,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
  CU_MEM_HANDLE_TYPE_WIN32 = 0x2,
  CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4,
};
enum CUmemLocationType : int {
  CU_MEM_LOCATION_TYPE_INVALID = 0x0,
  CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
};
enum CUmemAllocationGranularity_flags : int {
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
};
enum CUmemAccess_flags : int {
  CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
  CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
};

struct CUmemLocation {
  CUmemLocationType type;
  int id;
};

struct CUmemAllocationProp {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {
  CUmemLocation location;
  CUmemAccess_flags flags;
};

static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation is {int type; int id;}");
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout (64-bit)");
static_assert(offsetof(CUmemAllocationProp, requestedHandleTypes) == 4, "");
static_assert(offsetof(CUmemAllocationProp, location) == 8, "");
static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "");
static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is {CUmemLocation; flags}");
static_assert(sizeof(CUdeviceptr) == 8 && sizeof(void*) == 8, "64-bit platforms only");

// ---- flags ----
inline constexpr unsigned int CU_STREAM_DEFAULT = 0x0;
inline constexpr unsigned int CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr unsigned int CU_EVENT_DEFAULT = 0x0;
inline constexpr unsigned int CU_EVENT_BLOCKING_SYNC = 0x1;
inline constexpr unsigned int CU_EVENT_DISABLE_TIMING = 0x2;
inline constexpr unsigned int CU_EVENT_INTERPROCESS = 0x4;
inline constexpr unsigned int CU_MEMHOSTALLOC_PORTABLE = 0x1;
inline constexpr unsigned int CU_MEMHOSTALLOC_DEVICEMAP = 0x2;
inline constexpr unsigned int CU_MEMHOSTALLOC_WRITECOMBINED = 0x4;
// Special stream handles (cuda.h): the legacy and the per-thread default stream.
inline constexpr std::uintptr_t CU_STREAM_LEGACY = 0x1;
inline constexpr std::uintptr_t CU_STREAM_PER_THREAD = 0x2;

// ---- entry points: X(member, exported symbol, return type, parameter list) ----
// The member is the name code written against cuda.h uses; the symbol is what libcuda.so.1
// exports for it.
#define VMALLOC_CUDA_ENTRY_POINTS(X)                                                          \
  X(cuInit, "cuInit", (unsigned int flags))                                                  \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int* version))                                \
  X(cuGetErrorName, "cuGetErrorName", (CUresult error, const char** name))                   \
  X(cuGetErrorString, "cuGetErrorString", (CUresult error, const char** text))               \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice * device, int ordinal))                            \
  X(cuDeviceGetCount, "cuDeviceGetCount", (int* count))                                      \
  X(cuDeviceGetName, "cuDeviceGetName", (char* name, int length, CUdevice device))           \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (std::size_t * bytes, CUdevice device))         \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext * context, CUdevice device)) \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice device))            \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext * context))                               \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext context))                                 \
  X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", (CUcontext context))                            \
  X(cuCtxPopCurrent, "cuCtxPopCurrent_v2", (CUcontext * context))                            \
  X(cuCtxSynchronize, "cuCtxSynchronize", ())                                                \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",                          \
    (std::size_t * granularity, const CUmemAllocationProp* prop,                             \
     CUmemAllocationGranularity_flags option))                                               \
  X(cuMemCreate, "cuMemCreate",                                                              \
    (CUmemGenericAllocationHandle * handle, std::size_t size, const CUmemAllocationProp* prop, \
     unsigned long long flags))                                                              \
  X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle handle))                     \
  X(cuMemAddressReserve, "cuMemAddressReserve",                                              \
    (CUdeviceptr * ptr, std::size_t size, std::size_t alignment, CUdeviceptr addr,           \
     unsigned long long flags))                                                              \
  X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr ptr, std::size_t size))               \
  X(cuMemMap, "cuMemMap",                                                                    \
    (CUdeviceptr ptr, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle handle, \
     unsigned long long flags))                                                              \
  X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr ptr, std::size_t size))                           \
  X(cuMemSetAccess, "cuMemSetAccess",                                                        \
    (CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc, std::size_t count))     \
  X(cuMemHostAlloc, "cuMemHostAlloc", (void** ptr, std::size_t size, unsigned int flags))    \
  X(cuMemFreeHost, "cuMemFreeHost", (void* ptr))                                             \
  X(cuStreamCreate, "cuStreamCreate", (CUstream * stream, unsigned int flags))               \
  X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream stream))                                \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream stream))                           \
  X(cuStreamWaitEvent, "cuStreamWaitEvent", (CUstream stream, CUevent event, unsigned int flags)) \
  X(cuEventCreate, "cuEventCreate", (CUevent * event, unsigned int flags))                   \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent event))                                    \
  X(cuEventRecord, "cuEventRecord", (CUevent event, CUstream stream))                        \
  X(cuEventQuery, "cuEventQuery", (CUevent event))                                           \
  X(cuEventSynchronize, "cuEventSynchronize", (CUevent event))                               \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2",                                               \
    (CUdeviceptr dst, const void* src, std::size_t bytes, CUstream stream))                  \
  X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2",                                               \
    (void* dst, CUdeviceptr src, std::size_t bytes, CUstream stream))                        \
  X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2",                                               \
    (CUdeviceptr dst, CUdeviceptr src, std::size_t bytes, CUstream stream))

// The entry points of one loaded driver library. Every pointer is non-null.
struct DriverApi {
#define VMALLOC_CUDA_MEMBER(member, symbol, params) CUresult(*member) params = nullptr;
  VMALLOC_CUDA_ENTRY_POINTS(VMALLOC_CUDA_MEMBER)
#undef VMALLOC_CUDA_MEMBER
  // Optional: the emulator's "why did the last call fail" (vmallocEmulatorLastError), null
  // for the real driver. Used only to enrich error messages.
  std::size_t (*emulator_last_error)(char* buffer, std::size_t size) = nullptr;
  std::string path;  // the library actually loaded
};

// The library CudaDevice loads: $VMALLOC_LIBCUDA if set and not empty, else "libcuda.so.1".
std::string default_driver_library();

// dlopen()s `path` (once per path; never unloaded, as the CUDA runtime does) and resolves every
// entry point. Throws DeviceError naming the library and what is missing: call "dlopen" with
// CUDA_ERROR_NO_DEVICE when the library cannot be loaded, call "dlsym" with
// CUDA_ERROR_NOT_FOUND when an entry point is absent. Thread-safe.
const DriverApi& load_driver(const std::string& path);

// The exported symbol names CudaDevice resolves, in table order.
std::vector<std::string> driver_entry_point_symbols();

// "CUDA_ERROR_INVALID_VALUE" for 1, ... (the codes above); "CUresult <n>" otherwise.
std::string cu_result_name(CUresult result);
// The driver's description of a code ("invalid argument" for 1, ...); null when unknown.
const char* cu_result_description(CUresult result) noexcept;
// The name without allocation, or null for an unknown code (for the emulator's cuGetErrorName).
const char* cu_result_name_or_null(CUresult result) noexcept;

}  // namespace vmalloc::driver
