# include/vmalloc/trace/normalizer.hpp: the normalization of raw records in C++.
from libc.stdint cimport uint64_t
from libcpp.vector cimport vector

from vmalloc._lib.trace.replay cimport TraceEvent

# The readers grow vectors as they read: `except +` turns a std::bad_alloc into MemoryError
# instead of terminating the process.
cdef extern from "vmalloc/trace/normalizer.hpp" namespace "vmalloc::trace_parse" nogil:
    cdef cppclass Normalizer:
        void live_before(const TraceEvent* events, size_t n) except +
        void feed(const TraceEvent* records, size_t n) except +
        vector[TraceEvent] pending
        uint64_t skipped[4]
        vector[int] reason_order
        uint64_t implicit_frees, unmatched_frees, double_frees, free_size_mismatches
        uint64_t synthetic_allocs, frees_before_window
        uint64_t allocs, frees, largest
        void wide(int which, uint64_t& hi, uint64_t& lo)
        size_t live_count()
        size_t stream_count()
