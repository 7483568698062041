# include/vmalloc/device/host_device.hpp: a GPU emulated on host memory.
from libc.stdint cimport uint64_t, uintptr_t
from libcpp cimport bool

from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/device/host_device.hpp" namespace "vmalloc" nogil:
    cdef cppclass CHostDeviceOptions "vmalloc::HostDeviceOptions":
        size_t capacity
        size_t granularity
        bool backed
        int ordinal
        bool checked

    cdef cppclass CHostDeviceState "vmalloc::HostDeviceState":
        size_t physical_allocations
        size_t released_still_mapped
        size_t reservations
        size_t mappings
        size_t bytes_created
        size_t bytes_reserved
        size_t bytes_mapped
        size_t bytes_accessible
        size_t host_allocations
        size_t host_bytes
        size_t streams
        size_t events
        size_t vmas
        size_t live_allocations
        size_t bytes_guarded
        size_t unguarded_frees
        size_t guard_runs
        size_t guard_runs_cap
        size_t guards_recycled

    cdef cppclass CHostDevice "vmalloc::HostDevice"(CDevice):
        CHostDevice(const CHostDeviceOptions& options) except +vmalloc_raise_py_error
        CHostDeviceState state() except +vmalloc_raise_py_error
        bool checked()
        uint64_t hold_stream(uintptr_t stream) except +vmalloc_raise_py_error
        uintptr_t create_stream(bool non_blocking) except +vmalloc_raise_py_error
        void release_hold(uint64_t hold) except +vmalloc_raise_py_error

    # HostDevice's static members: the process-wide limit of kernel memory mappings.
    size_t host_device_vma_limit "vmalloc::HostDevice::vma_limit"()
    void host_device_set_vma_limit "vmalloc::HostDevice::set_vma_limit"(size_t limit)
    size_t host_device_process_vmas "vmalloc::HostDevice::process_vmas"()
