# include/vmalloc/alloc/virtual_allocator.hpp: the virtual-addressing allocator, chunks
# placement.
from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


# ChunkStats: moves to chunk_stats.hpp
cdef extern from "vmalloc/alloc/virtual_allocator.hpp" namespace "vmalloc" nogil:
    cdef cppclass ChunkStats:
        size_t chunk_size
        size_t small_threshold
        size_t budget_bytes
        size_t chunks_held
        size_t peak_chunks_held
        size_t chunks_live
        size_t chunks_cached
        size_t chunks_in_arenas
        size_t chunks_in_pool
        size_t free_chunks
        size_t arena_chunks_empty
        size_t cached_ranges
        size_t live_ranges
        size_t live_blocks
        size_t free_blocks
        size_t arena_free_bytes
        size_t reservations
        size_t reserved_address_bytes
        size_t chunks_created
        size_t chunks_released
        size_t chunks_stolen
        size_t unbacked_ranges
        size_t chunks_unbacked
        size_t unbacked_bytes
        size_t events_created
        bool multi_stream


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
