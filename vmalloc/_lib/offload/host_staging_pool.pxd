# include/vmalloc/offload/host_staging_pool.hpp: the pinned host memory behind swap-outs.

from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/offload/host_staging_pool.hpp" namespace "vmalloc" nogil:
    cdef cppclass CHostStagingStats "vmalloc::HostStagingStats":
        size_t capacity_bytes
        size_t in_use_bytes
        size_t peak_in_use_bytes
        size_t cached_bytes
        size_t blocks_in_use
        size_t blocks_cached
        size_t host_alloc_calls
        size_t host_free_calls
        size_t reuses

    cdef cppclass CHostStagingPool "vmalloc::HostStagingPool":
        void* allocate(size_t nbytes) except +vmalloc_raise_py_error
        void deallocate(void* ptr) except +vmalloc_raise_py_error
        @staticmethod
        size_t size_class(size_t nbytes)
