# cython: language_level=3
"""LoggingAllocator: any vmalloc allocator, recording its allocations to a .vmtrace file."""

import os

from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr, static_pointer_cast
from libcpp.string cimport string

from vmalloc._allocator cimport Allocator, CAllocator
from vmalloc._device cimport vmalloc_raise_py_error


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


cdef class LoggingAllocator(Allocator):
    """Wraps ``allocator``: every call is forwarded to it, and each allocation and free is
    recorded to the ``.vmtrace`` file at ``path`` (created or truncated), ready for
    ``vmalloc replay`` or :func:`vmalloc.traces.open_trace`.

    Works wherever an allocator does, including as PyTorch's or CuPy's allocator through
    :func:`vmalloc.set_current_allocator`. Records are buffered; :meth:`close` (or leaving a
    ``with`` block, or the last reference going away) completes the file. Thread-safe.

    Example::

        device = vmalloc.HostDevice(capacity="1GiB")
        with vmalloc.LoggingAllocator(vmalloc.CachingAllocator(device), "job.vmtrace") as log:
            p = log.allocate("3MiB")
            log.deallocate(p)
        trace = vmalloc.traces.open_trace("job.vmtrace")
    """

    cdef CLoggingAllocator* logging
    cdef readonly Allocator upstream
    cdef readonly str path

    def __init__(self, Allocator allocator not None, path):
        if self.c_allocator:
            raise RuntimeError("LoggingAllocator is already initialized: __init__ cannot be "
                               "called twice; create a new LoggingAllocator")
        cdef string c_path = os.fsencode(path)
        if not allocator.c_allocator:
            raise ValueError("the allocator to wrap is not initialized")
        cdef shared_ptr[CAllocator] upstream = allocator.c_allocator
        cdef shared_ptr[CLoggingAllocator] adaptor
        with nogil:
            adaptor = shared_ptr[CLoggingAllocator](new CLoggingAllocator(upstream, c_path))
        self.logging = adaptor.get()
        self.c_allocator = static_pointer_cast[CAllocator, CLoggingAllocator](adaptor)
        self.device = allocator.device
        self.upstream = allocator
        self.path = os.fsdecode(path)

    def flush(self):
        """Writes buffered records to the file. Raises :class:`vmalloc.VmallocError` if a
        write failed (recording stops at the first failure; allocations go on)."""
        self.get()
        cdef CLoggingAllocator* adaptor = self.logging
        with nogil:
            adaptor.flush()

    def close(self):
        """Completes the trace file. Afterwards :meth:`allocate` raises and
        :meth:`deallocate` still gives memory back, unrecorded. Idempotent."""
        self.get()
        cdef CLoggingAllocator* adaptor = self.logging
        with nogil:
            adaptor.close()

    @property
    def closed(self):
        """True once :meth:`close` was called."""
        self.get()
        cdef CLoggingAllocator* adaptor = self.logging
        cdef bool value
        with nogil:
            value = adaptor.closed()
        return value

    @property
    def events_written(self):
        """Events recorded so far (buffered ones included)."""
        self.get()
        cdef CLoggingAllocator* adaptor = self.logging
        cdef uint64_t value
        with nogil:
            value = adaptor.events_written()
        return value

    @property
    def unrecorded_frees(self):
        """Frees of pointers allocated before the wrapping (forwarded, not recorded)."""
        self.get()
        cdef CLoggingAllocator* adaptor = self.logging
        cdef uint64_t value
        with nogil:
            value = adaptor.unrecorded_frees()
        return value

    @property
    def failed_allocations(self):
        """Allocations the wrapped allocator refused (not in the trace)."""
        self.get()
        cdef CLoggingAllocator* adaptor = self.logging
        cdef uint64_t value
        with nogil:
            value = adaptor.failed_allocations()
        return value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
