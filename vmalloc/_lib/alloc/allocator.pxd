# include/vmalloc/alloc/allocator.hpp: the interface every allocator implements.
from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string

from vmalloc._lib.base.stats cimport CStats
from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


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
        const shared_ptr[CDevice]& device()
