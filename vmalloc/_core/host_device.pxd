# HostDevice, the wrapper of vmalloc::HostDevice (vmalloc/_lib/device/host_device.pxd).
from vmalloc._core.device cimport Device
from vmalloc._lib.device.host_device cimport CHostDevice


cdef class HostDevice(Device):
    cdef CHostDevice* host(self) except NULL
