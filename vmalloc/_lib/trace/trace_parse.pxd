# include/vmalloc/trace/trace_parse.hpp: the C++ fast path of the RMM CSV and Kineto JSON
# readers and of their normalization.
from libc.stdint cimport int64_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from vmalloc._lib.trace.replay cimport TraceEvent


# The parsers grow vectors as they read: `except +` turns a std::bad_alloc into MemoryError
# instead of terminating the process.
cdef extern from "vmalloc/trace/trace_parse.hpp" namespace "vmalloc::trace_parse" nogil:
    cdef cppclass RmmCsvParser:
        bool feed(const char* data, size_t n, vector[TraceEvent]& out) except +
        bool finish(vector[TraceEvent]& out) except +
        const vector[string]& columns()
        uint64_t allocate_failures()

    cdef cppclass BeforeWindowScanner:
        void feed(const TraceEvent* records, size_t n) except +
        vector[TraceEvent] before

    cdef cppclass DeviceScan "vmalloc::trace_parse::KinetoScanner::DeviceScan":
        BeforeWindowScanner scan
        bool have_allocated
        int64_t first_allocated
        bool first_bytes_negative
        uint64_t first_bytes
        vector[vector[TraceEvent]] kept
        uint64_t matched, out_of_order, zero_bytes
        bool have_peak_allocated, have_reserved
        int64_t peak_allocated, peak_reserved

    cdef cppclass KinetoScanner:
        KinetoScanner(int64_t want_type, int64_t want_id) except +
        bool feed(const char* data, size_t n, vector[TraceEvent]& out) except +
        bool finish(vector[TraceEvent]& out) except +
        vector[pair[string, string]] metadata
        vector[pair[pair[int64_t, int64_t], uint64_t]] devices
        uint64_t out_of_order, ooms, zero_bytes, matched
        bool have_allocated, have_reserved
        int64_t peak_allocated, peak_reserved, first_allocated
        bool first_bytes_negative
        uint64_t first_bytes
        vector[DeviceScan] device_scans
        bool scans_ok
        size_t keep_limit, kept_bytes
        bool kept_dropped

    cdef cppclass Normalizer:
        void live_before(const TraceEvent* events, size_t n) except +
        void feed(const TraceEvent* records, size_t n) except +
        vector[TraceEvent] pending
        uint64_t skipped[4]
        vector[int] reason_order
        uint64_t implicit_frees, unmatched_frees, free_size_mismatches, synthetic_allocs
        uint64_t frees_before_window
        uint64_t allocs, frees, largest
        void wide(int which, uint64_t& hi, uint64_t& lo)
        size_t live_count()
        size_t stream_count()
