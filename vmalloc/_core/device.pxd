# The Python base class of the device wrappers (HostDevice, CudaDevice). The C++ interface it
# wraps is declared in vmalloc/_lib/device/device.pxd.
from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr

from vmalloc._lib.device.device cimport CDevice


cdef class Device:
    cdef shared_ptr[CDevice] c_device
    cdef bint init_called  # see vmalloc/_core/init_once.pxd
    cdef CDevice* get(self) except NULL


# A plain Device over a C++ device that has no Python wrapper yet (one reached through an
# allocator set by the C ABI).
cdef Device wrap_device(shared_ptr[CDevice] c_device)

# A stream argument as a CUstream integer: ints pass through; CuPy streams give .ptr,
# PyTorch streams .cuda_stream.
cdef uintptr_t stream_handle(object stream) except? 0
