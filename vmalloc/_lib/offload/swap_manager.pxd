# include/vmalloc/offload/swap_manager.hpp: swapping live allocations to pinned host memory and
# back.
from libc.stdint cimport uintptr_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.pair cimport pair
from libcpp.vector cimport vector

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.offload.host_staging_pool cimport CHostStagingPool, CHostStagingStats
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/offload/swap_manager.hpp" namespace "vmalloc" nogil:
    cdef enum class CSwapState "vmalloc::SwapState":
        resident "vmalloc::SwapState::resident"
        swapping_out "vmalloc::SwapState::swapping_out"
        on_host "vmalloc::SwapState::on_host"
        swapping_in "vmalloc::SwapState::swapping_in"

    const char* swap_state_name(CSwapState state)

    cdef cppclass CSwapManagerOptions "vmalloc::SwapManagerOptions":
        size_t host_capacity

    cdef cppclass CSwapStats "vmalloc::SwapStats":
        size_t swap_outs
        size_t bytes_swapped_out
        size_t swap_ins
        size_t bytes_swapped_in
        size_t cancelled_swap_outs
        size_t relocations
        size_t relocating_swap_outs
        size_t oom_retries
        size_t swap_in_failures
        size_t host_waits
        double wait_seconds
        size_t swapping_out
        size_t on_host
        size_t swapping_in
        size_t events_created
        CHostStagingStats host

    # An Allocator too (allocate, deallocate(ptr, nbytes, stream), stats() of the upstream...).
    cdef cppclass CSwapManager "vmalloc::SwapManager"(CAllocator):
        CSwapManager(shared_ptr[CAllocator] allocator,
                     const CSwapManagerOptions& options) except +vmalloc_raise_py_error
        uintptr_t swap_out(uintptr_t ptr, uintptr_t stream) except +vmalloc_raise_py_error
        uintptr_t swap_in(uintptr_t ptr, uintptr_t stream) except +vmalloc_raise_py_error
        void wait(uintptr_t ptr, uintptr_t stream) except +vmalloc_raise_py_error
        CSwapState state(uintptr_t ptr) except +vmalloc_raise_py_error
        bool discard(uintptr_t ptr) except +vmalloc_raise_py_error
        size_t poll() except +vmalloc_raise_py_error
        size_t swap_out_all(uintptr_t stream, vector[pair[uintptr_t, uintptr_t]]* keys) \
            except +vmalloc_raise_py_error
        size_t swap_in_all(uintptr_t stream,
                           vector[pair[uintptr_t, uintptr_t]]& moved) \
            except +vmalloc_raise_py_error
        CSwapStats swap_stats() except +vmalloc_raise_py_error
        size_t release_cached_host() except +vmalloc_raise_py_error
        bool relocates(uintptr_t ptr) except +vmalloc_raise_py_error
        uintptr_t d2h_stream()
        uintptr_t h2d_stream()
        CHostStagingPool& staging()
