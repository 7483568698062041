# include/vmalloc/alloc/packed_virtual_allocator.hpp: the virtual-addressing allocator, packed
# placement.
from libcpp cimport bool
from libcpp.memory cimport shared_ptr

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.alloc.chunk_stats cimport ChunkStats
from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/alloc/packed_virtual_allocator.hpp" namespace "vmalloc" nogil:
    cdef cppclass PackedVirtualAllocatorOptions:
        size_t chunk_size
        size_t budget
        size_t small_threshold
        size_t reservation_size
        bool steal_before_create
        double remap_slack

    size_t packed_default_small_threshold \
        "vmalloc::PackedVirtualAllocatorOptions::default_small_threshold"

    cdef cppclass PackedStats:
        size_t chunk_size
        size_t small_threshold
        size_t reservation_size
        bool steal_before_create
        double remap_slack
        size_t budget_bytes
        size_t chunks_held
        size_t peak_chunks_held
        size_t chunks_live
        size_t chunks_free_mapped
        size_t chunks_in_pool
        size_t free_chunks
        size_t live_blocks
        size_t free_holes
        size_t hole_bytes
        size_t reservations
        size_t reserved_address_bytes
        size_t chunks_created
        size_t chunks_released
        size_t chunks_stolen
        size_t fresh_placements
        size_t events_created
        bool multi_stream

    cdef cppclass CPackedVirtualAllocator "vmalloc::PackedVirtualAllocator"(CAllocator):
        @staticmethod
        shared_ptr[CPackedVirtualAllocator] create(
            shared_ptr[CDevice] device,
            const PackedVirtualAllocatorOptions& options) except +vmalloc_raise_py_error
        PackedStats packed_stats() except +vmalloc_raise_py_error
        ChunkStats chunk_stats() except +vmalloc_raise_py_error
        size_t chunk_size()
        size_t small_threshold()
        size_t reservation_size()
        bool steal_before_create()
        double remap_slack()
        size_t budget()
