# include/vmalloc/trace/replay.hpp: the replay engine and the trace event it reads (the layout
# of vmalloc.traces.events.EVENT_DTYPE).
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.vector cimport vector

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/trace/replay.hpp" namespace "vmalloc" nogil:
    cdef cppclass TraceEvent:
        uint8_t op
        uint64_t stream
        uint64_t addr
        uint64_t size

    cdef cppclass ReplayOptions:
        size_t timeline_points
        bool stop_on_out_of_memory

    cdef cppclass TimelinePoint:
        uint64_t first_event
        size_t requested_bytes
        size_t reserved_bytes

    cdef cppclass ReplayCounts:
        uint64_t events
        uint64_t allocations
        uint64_t frees
        uint64_t unknown_frees
        uint64_t reused_addresses
        uint64_t out_of_memory_count
        int64_t out_of_memory_event
        size_t out_of_memory_request_bytes
        size_t live_allocations
        size_t requested_bytes
        size_t peak_requested_bytes
        size_t streams

    cdef cppclass CReplay "vmalloc::Replay":
        CReplay(shared_ptr[CAllocator] allocator,
                ReplayOptions options) except +vmalloc_raise_py_error
        bool feed(const TraceEvent* events, size_t n) except +vmalloc_raise_py_error
        bool stopped()
        ReplayCounts counts()
        vector[TimelinePoint] timeline() except +vmalloc_raise_py_error
        uint64_t timeline_stride()
