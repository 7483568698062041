# LoggingAllocator, the wrapper of vmalloc::LoggingAllocator
# (vmalloc/_lib/trace/logging_allocator.pxd).
from vmalloc._core.allocator cimport Allocator
from vmalloc._lib.trace.logging_allocator cimport CLoggingAllocator


cdef class LoggingAllocator(Allocator):
    cdef CLoggingAllocator* c_logging  # c_allocator, as its class (c_allocator owns it)
    cdef readonly Allocator upstream
    cdef readonly str path
    cdef CLoggingAllocator* logger(self) except NULL
