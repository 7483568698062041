# CudaDevice, the wrapper of vmalloc::CudaDevice (vmalloc/_lib/device/cuda_device.pxd).
from vmalloc._core.device cimport Device
from vmalloc._lib.device.cuda_device cimport CCudaDevice


cdef class CudaDevice(Device):
    cdef CCudaDevice* cuda(self) except NULL
