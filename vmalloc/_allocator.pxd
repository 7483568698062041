# Declarations of the C++ allocator interface (include/vmalloc/alloc/allocator.hpp) and the Python
# base class of every allocator wrapper (VirtualAllocator, CachingAllocator, ...).
from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string

from vmalloc._device cimport CDevice, Device, vmalloc_raise_py_error


cdef extern from "vmalloc/base/stats.hpp" namespace "vmalloc" nogil:
    cdef cppclass CStats "vmalloc::Stats":
        size_t requested_bytes
        size_t peak_requested_bytes
        size_t reserved_bytes
        size_t peak_reserved_bytes
        size_t allocated_bytes
        size_t peak_allocated_bytes
        size_t internal_fragmentation_bytes
        size_t peak_internal_fragmentation_bytes
        size_t cached_bytes
        size_t live_allocations
        size_t peak_live_allocations
        size_t total_allocations
        size_t total_deallocations
        size_t out_of_memory_count
        string summary()


cdef extern from "vmalloc/base/types.hpp" namespace "vmalloc" nogil:
    cdef size_t unknown_size


cdef extern from "vmalloc/alloc/allocator.hpp" namespace "vmalloc" nogil:
    cdef cppclass CAllocator "vmalloc::Allocator":
        uintptr_t allocate(size_t nbytes, uintptr_t stream) except +vmalloc_raise_py_error
        void deallocate(uintptr_t ptr, size_t nbytes,
                        uintptr_t stream) except +vmalloc_raise_py_error
        size_t release_cached() except +vmalloc_raise_py_error
        CStats stats() except +vmalloc_raise_py_error
        void reset_peak_stats() except +vmalloc_raise_py_error
        size_t allocation_size(uintptr_t ptr) except +vmalloc_raise_py_error
        string name()


cdef object stats_from_c(const CStats& s)


cdef class Allocator:
    cdef shared_ptr[CAllocator] c_allocator
    cdef readonly Device device
    cdef CAllocator* get(self) except NULL
