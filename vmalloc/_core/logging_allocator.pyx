# cython: language_level=3
"""LoggingAllocator: any vmalloc allocator, recording its allocations to a .vmtrace file."""

import os

from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr, static_pointer_cast
from libcpp.string cimport string

from vmalloc._core.allocator cimport Allocator
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.trace.logging_allocator cimport CLoggingAllocator


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

    def __cinit__(self, Allocator allocator not None, path):
        allocator.get()  # raises for an allocator wrapper that holds none
        cdef string c_path = os.fsencode(path)
        cdef shared_ptr[CAllocator] upstream = allocator.c_allocator
        cdef shared_ptr[CLoggingAllocator] created
        with nogil:
            created = shared_ptr[CLoggingAllocator](new CLoggingAllocator(upstream, c_path))
        self.c_logging = created.get()
        self.c_allocator = static_pointer_cast[CAllocator, CLoggingAllocator](created)
        self.device = allocator.device
        self.upstream = allocator
        self.path = os.fsdecode(path)

    def __init__(self, Allocator allocator not None, path):
        refuse_second_init(self, &self.init_called)

    cdef CLoggingAllocator* logger(self) except NULL:
        self.get()  # raises for a Python subclass that holds no allocator
        return self.c_logging

    def flush(self):
        """Writes buffered records to the file. Raises :class:`vmalloc.VmallocError` if a
        write failed (recording stops at the first failure; allocations go on)."""
        cdef CLoggingAllocator* log = self.logger()
        with nogil:
            log.flush()

    def close(self):
        """Completes the trace file. Afterwards :meth:`allocate` raises and
        :meth:`deallocate` still gives memory back, unrecorded. Idempotent."""
        cdef CLoggingAllocator* log = self.logger()
        with nogil:
            log.close()

    @property
    def closed(self):
        """True once :meth:`close` was called."""
        cdef CLoggingAllocator* log = self.logger()
        cdef bool value
        with nogil:
            value = log.closed()
        return value

    @property
    def events_written(self):
        """Events recorded so far (buffered ones included)."""
        cdef CLoggingAllocator* log = self.logger()
        cdef uint64_t value
        with nogil:
            value = log.events_written()
        return value

    @property
    def unrecorded_frees(self):
        """Frees of pointers allocated before the wrapping (forwarded, not recorded)."""
        cdef CLoggingAllocator* log = self.logger()
        cdef uint64_t value
        with nogil:
            value = log.unrecorded_frees()
        return value

    @property
    def failed_allocations(self):
        """Allocations the wrapped allocator refused (not in the trace)."""
        cdef CLoggingAllocator* log = self.logger()
        cdef uint64_t value
        with nogil:
            value = log.failed_allocations()
        return value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
