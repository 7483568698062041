# include/vmalloc/trace/logging_allocator.hpp: an allocator that forwards to another and
# records every allocation and free to a .vmtrace file.
from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/trace/logging_allocator.hpp" namespace "vmalloc" nogil:
    cdef cppclass CLoggingAllocator "vmalloc::LoggingAllocator"(CAllocator):
        CLoggingAllocator(shared_ptr[CAllocator] upstream,
                          const string& path) except +vmalloc_raise_py_error
        void flush() except +vmalloc_raise_py_error
        void close() except +vmalloc_raise_py_error
        bool closed()
        uint64_t events_written()
        uint64_t unrecorded_frees()
        uint64_t failed_allocations()
