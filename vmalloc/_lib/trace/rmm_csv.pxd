# include/vmalloc/trace/rmm_csv.hpp: the C++ reader of RMM logging CSVs.
from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.vector cimport vector

from vmalloc._lib.trace.replay cimport TraceEvent

# The readers grow vectors as they read: `except +` turns a std::bad_alloc into MemoryError
# instead of terminating the process.
cdef extern from "vmalloc/trace/rmm_csv.hpp" namespace "vmalloc::trace_parse" nogil:
    cdef cppclass RmmCsvParser:
        bool feed(const char* data, size_t n, vector[TraceEvent]& out) except +
        bool finish(vector[TraceEvent]& out) except +
        const vector[string]& columns()
        uint64_t allocate_failures()
