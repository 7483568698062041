# include/vmalloc/alloc/virtual_allocator.hpp: the virtual-addressing allocator, chunks
# placement.
from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.alloc.chunk_stats cimport ChunkStats
from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/alloc/virtual_allocator.hpp" namespace "vmalloc" nogil:
    cdef cppclass VirtualAllocatorOptions:
        size_t chunk_size
        size_t budget
        size_t small_threshold
        bool steal_before_create

    size_t default_small_threshold "vmalloc::VirtualAllocatorOptions::default_small_threshold"

    cdef cppclass CVirtualAllocator "vmalloc::VirtualAllocator"(CAllocator):
        @staticmethod
        shared_ptr[CVirtualAllocator] create(shared_ptr[CDevice] device,
                                             const VirtualAllocatorOptions& options) \
            except +vmalloc_raise_py_error
        ChunkStats chunk_stats() except +vmalloc_raise_py_error
        size_t chunk_size()
        size_t small_threshold()
        size_t budget()
        bool steal_before_create()
        bool owns_chunks(uint64_t ptr) except +vmalloc_raise_py_error
        void unmap_backing(uint64_t ptr, uint64_t stream,
                           bool synchronize) except +vmalloc_raise_py_error
        void map_backing(uint64_t ptr, uint64_t stream) except +vmalloc_raise_py_error
