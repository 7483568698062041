# include/vmalloc/device/cuda_device.hpp: the device interface over the CUDA driver.
from libc.stdint cimport uintptr_t
from libcpp.string cimport string

from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/device/cuda_device.hpp" namespace "vmalloc" nogil:
    cdef cppclass CCudaDevice "vmalloc::CudaDevice"(CDevice):
        CCudaDevice(int ordinal, const string& library) except +vmalloc_raise_py_error
        const string& library()
        int driver_version()
        const string& device_name()
        uintptr_t context_handle()
