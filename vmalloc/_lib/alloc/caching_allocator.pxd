# include/vmalloc/alloc/caching_allocator.hpp: the best-fit caching allocator (PyTorch's,
# nnabla's and CuPy's policies).
from libc.stdint cimport uintptr_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/alloc/caching_allocator.hpp" namespace "vmalloc" nogil:
    cdef enum class CCachingPolicy "vmalloc::CachingPolicy":
        pytorch
        nnabla
        cupy

    const char* caching_policy_name(CCachingPolicy policy)
    CCachingPolicy parse_caching_policy(const string& name) except +vmalloc_raise_py_error

    cdef cppclass CCachingAllocatorOptions "vmalloc::CachingAllocatorOptions":
        CCachingPolicy policy
        size_t max_split_size
        size_t max_non_split_rounding_size
        size_t budget
        bool expandable_segments

    # CachingAllocatorOptions::unlimited: max_split_size when there is none.
    size_t caching_unlimited "vmalloc::CachingAllocatorOptions::unlimited"

    cdef cppclass CCachingSegmentStats "vmalloc::CachingSegmentStats":
        size_t small_segments
        size_t large_segments
        size_t small_segment_bytes
        size_t large_segment_bytes
        size_t live_blocks
        size_t free_blocks
        size_t free_bytes
        size_t largest_free_block
        size_t waiting_blocks
        size_t waiting_bytes
        size_t unsplit_free_segments
        size_t segments_created
        size_t segments_released
        size_t alloc_retries
        size_t cache_flushes

    cdef enum class CBlockState "vmalloc::CachingBlockInfo::State":
        allocated
        waiting
        free

    cdef cppclass CCachingBlockInfo "vmalloc::CachingBlockInfo":
        uintptr_t ptr
        size_t size
        size_t requested
        uintptr_t stream
        CBlockState state

    cdef cppclass CCachingSegmentInfo "vmalloc::CachingSegmentInfo":
        uintptr_t ptr
        size_t size
        bool small
        uintptr_t stream
        vector[CCachingBlockInfo] blocks

    cdef cppclass CCachingAllocator "vmalloc::CachingAllocator"(CAllocator):
        CCachingAllocator(shared_ptr[CDevice] device,
                          CCachingAllocatorOptions options) except +vmalloc_raise_py_error
        void record_stream(uintptr_t ptr, uintptr_t stream) except +vmalloc_raise_py_error
        CCachingSegmentStats segment_stats() except +vmalloc_raise_py_error
        vector[CCachingSegmentInfo] snapshot() except +vmalloc_raise_py_error
        const CCachingAllocatorOptions& options()
        size_t round_size(size_t nbytes)
        bool is_small(size_t rounded)
        size_t segment_size(size_t rounded)
