# include/vmalloc/trace/before_window.hpp: the scan for memory allocated before a trace's
# window.
from libcpp.vector cimport vector

from vmalloc._lib.trace.replay cimport TraceEvent

# The readers grow vectors as they read: `except +` turns a std::bad_alloc into MemoryError
# instead of terminating the process.
cdef extern from "vmalloc/trace/before_window.hpp" namespace "vmalloc::trace_parse" nogil:
    cdef cppclass BeforeWindowScanner:
        void feed(const TraceEvent* records, size_t n) except +
        vector[TraceEvent] before
