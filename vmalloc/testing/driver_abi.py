"""The CUDA driver's C interface as ctypes declarations: enough to call the driver emulator
(or a real ``libcuda.so.1``) directly from Python tests.

Structures and constants follow cuda.h (64-bit); :func:`bind` sets ``argtypes``/``restype`` of
every entry point vmalloc uses on a loaded library, under the names cuda.h code writes::

    lib = vmalloc.testing.driver_abi.bind(ctypes.CDLL(vmalloc.testing.emulated_driver_path()))
    assert lib.cuInit(0) == 0
"""

import ctypes
from ctypes import POINTER, Structure, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_ulonglong
from ctypes import c_ushort, c_void_p

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CU_EVENT_INTERPROCESS = 4
CU_MEMHOSTALLOC_PORTABLE = 1

CUresult = c_int
CUdevice = c_int
CUdeviceptr = c_ulonglong
CUmemGenericAllocationHandle = c_ulonglong
CUcontext = c_void_p
CUstream = c_void_p
CUevent = c_void_p


class CUmemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAllocFlags(Structure):
    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte),
                ("usage", c_ushort), ("reserved", c_ubyte * 4)]


class CUmemAllocationProp(Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


assert ctypes.sizeof(CUmemAllocationProp) == 32 and ctypes.sizeof(CUmemAccessDesc) == 12


def allocation_prop(ordinal):
    """The ``CUmemAllocationProp`` vmalloc passes: pinned memory on device ``ordinal``."""
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def access_desc(ordinal, flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
    """A ``CUmemAccessDesc`` giving device ``ordinal`` ``flags`` access."""
    desc = CUmemAccessDesc()
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = flags
    return desc


#: cuda.h name -> (exported symbol, argument types). Every entry point returns CUresult.
ENTRY_POINTS = {
    "cuInit": ("cuInit", [c_uint]),
    "cuDriverGetVersion": ("cuDriverGetVersion", [POINTER(c_int)]),
    "cuGetErrorName": ("cuGetErrorName", [CUresult, POINTER(c_char_p)]),
    "cuGetErrorString": ("cuGetErrorString", [CUresult, POINTER(c_char_p)]),
    "cuDeviceGet": ("cuDeviceGet", [POINTER(CUdevice), c_int]),
    "cuDeviceGetCount": ("cuDeviceGetCount", [POINTER(c_int)]),
    "cuDeviceGetName": ("cuDeviceGetName", [c_char_p, c_int, CUdevice]),
    "cuDeviceTotalMem": ("cuDeviceTotalMem_v2", [POINTER(c_size_t), CUdevice]),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", [POINTER(CUcontext), CUdevice]),
    "cuDevicePrimaryCtxRelease": ("cuDevicePrimaryCtxRelease_v2", [CUdevice]),
    "cuCtxGetCurrent": ("cuCtxGetCurrent", [POINTER(CUcontext)]),
    "cuCtxSetCurrent": ("cuCtxSetCurrent", [CUcontext]),
    "cuCtxPushCurrent": ("cuCtxPushCurrent_v2", [CUcontext]),
    "cuCtxPopCurrent": ("cuCtxPopCurrent_v2", [POINTER(CUcontext)]),
    "cuCtxSynchronize": ("cuCtxSynchronize", []),
    "cuMemGetAllocationGranularity": (
        "cuMemGetAllocationGranularity",
        [POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int]),
    "cuMemCreate": ("cuMemCreate", [POINTER(CUmemGenericAllocationHandle), c_size_t,
                                    POINTER(CUmemAllocationProp), c_ulonglong]),
    "cuMemRelease": ("cuMemRelease", [CUmemGenericAllocationHandle]),
    "cuMemAddressReserve": ("cuMemAddressReserve", [POINTER(CUdeviceptr), c_size_t, c_size_t,
                                                    CUdeviceptr, c_ulonglong]),
    "cuMemAddressFree": ("cuMemAddressFree", [CUdeviceptr, c_size_t]),
    "cuMemMap": ("cuMemMap", [CUdeviceptr, c_size_t, c_size_t, CUmemGenericAllocationHandle,
                              c_ulonglong]),
    "cuMemUnmap": ("cuMemUnmap", [CUdeviceptr, c_size_t]),
    "cuMemSetAccess": ("cuMemSetAccess", [CUdeviceptr, c_size_t, POINTER(CUmemAccessDesc),
                                          c_size_t]),
    "cuMemHostAlloc": ("cuMemHostAlloc", [POINTER(c_void_p), c_size_t, c_uint]),
    "cuMemFreeHost": ("cuMemFreeHost", [c_void_p]),
    "cuStreamCreate": ("cuStreamCreate", [POINTER(CUstream), c_uint]),
    "cuStreamDestroy": ("cuStreamDestroy_v2", [CUstream]),
    "cuStreamSynchronize": ("cuStreamSynchronize", [CUstream]),
    "cuStreamWaitEvent": ("cuStreamWaitEvent", [CUstream, CUevent, c_uint]),
    "cuEventCreate": ("cuEventCreate", [POINTER(CUevent), c_uint]),
    "cuEventDestroy": ("cuEventDestroy_v2", [CUevent]),
    "cuEventRecord": ("cuEventRecord", [CUevent, CUstream]),
    "cuEventQuery": ("cuEventQuery", [CUevent]),
    "cuEventSynchronize": ("cuEventSynchronize", [CUevent]),
    "cuMemcpyHtoDAsync": ("cuMemcpyHtoDAsync_v2", [CUdeviceptr, c_void_p, c_size_t, CUstream]),
    "cuMemcpyDtoHAsync": ("cuMemcpyDtoHAsync_v2", [c_void_p, CUdeviceptr, c_size_t, CUstream]),
    "cuMemcpyDtoDAsync": ("cuMemcpyDtoDAsync_v2", [CUdeviceptr, CUdeviceptr, c_size_t,
                                                   CUstream]),
}


class _Bound:
    """The entry points of one library as attributes named as in cuda.h."""

    def __init__(self, lib):
        self.library = lib
        for name, (symbol, argtypes) in ENTRY_POINTS.items():
            function = getattr(lib, symbol)
            function.restype = CUresult
            function.argtypes = argtypes
            setattr(self, name, function)


def bind(lib):
    """Returns an object whose attributes are ``lib``'s driver entry points with their C
    signatures, named as cuda.h code names them (``cuMemcpyHtoDAsync`` calls the exported
    ``cuMemcpyHtoDAsync_v2``)."""
    return _Bound(lib)
