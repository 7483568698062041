# include/vmalloc/trace/kineto_scanner.hpp: the C++ scanner of PyTorch profiler (Kineto) JSON.
from libc.stdint cimport int64_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from vmalloc._lib.trace.replay cimport TraceEvent
from vmalloc._lib.trace.before_window cimport BeforeWindowScanner

# The readers grow vectors as they read: `except +` turns a std::bad_alloc into MemoryError
# instead of terminating the process.
cdef extern from "vmalloc/trace/kineto_scanner.hpp" namespace "vmalloc::trace_parse" nogil:
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
