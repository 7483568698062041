# include/vmalloc/chunks/physical_chunk_pool.hpp: fixed-size physical chunks and their cache.
from libc.stdint cimport uint64_t
from libcpp.memory cimport shared_ptr

from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/chunks/physical_chunk_pool.hpp" namespace "vmalloc" nogil:
    cdef cppclass ChunkPoolStats:
        size_t chunk_size
        size_t budget_bytes
        size_t chunks_held
        size_t peak_chunks_held
        size_t chunks_cached
        size_t chunks_created
        size_t chunks_released

    cdef cppclass CPhysicalChunkPool "vmalloc::PhysicalChunkPool":
        CPhysicalChunkPool(shared_ptr[CDevice] device, size_t chunk_size,
                           size_t budget) except +vmalloc_raise_py_error
        uint64_t acquire() except +vmalloc_raise_py_error
        uint64_t take_cached() except +vmalloc_raise_py_error
        uint64_t create() except +vmalloc_raise_py_error
        void give_back(uint64_t chunk) except +vmalloc_raise_py_error
        void release(uint64_t chunk) except +vmalloc_raise_py_error
        size_t release_cached() except +vmalloc_raise_py_error
        size_t creatable_chunks() except +vmalloc_raise_py_error
        ChunkPoolStats stats() except +vmalloc_raise_py_error
