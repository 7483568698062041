# cython: language_level=3
"""The replay engine's Python face: feeds trace batches to an allocator without the GIL."""

from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.vector cimport vector

from vmalloc._core.allocator cimport Allocator
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.trace.replay cimport (
    CReplay,
    ReplayCounts,
    ReplayOptions,
    TimelinePoint,
    TraceEvent,
)

import numpy as np

from vmalloc.errors import InvalidArgumentError
from vmalloc.traces.events import EVENT_DTYPE


cdef class Replay:
    """Replays trace events into ``allocator``, one batch at a time.

    Trace addresses are mapped to the addresses ``allocator`` returns, trace streams to
    streams created on its device (trace stream 0 is the default stream). A free of an address
    that is not live in the trace is counted (``unknown_frees``), not an error: snapshots are
    ring buffers that lose old allocations.

    Args:
        allocator: any :class:`vmalloc.Allocator`.
        timeline_points: the timeline keeps between this many and twice this many points,
            whatever the trace length; 0 keeps none (faster).
        stop_on_out_of_memory: stop at the first allocation that runs out of memory (then
            :meth:`feed` returns False); otherwise count it and go on without that allocation.
    """

    def __cinit__(self, Allocator allocator not None, timeline_points=2048,
                  stop_on_out_of_memory=True):
        cdef ReplayOptions options
        allocator.get()  # raises for an allocator wrapper that holds none
        if timeline_points < 0:
            raise InvalidArgumentError(
                f"timeline_points must not be negative, got {timeline_points}")
        options.timeline_points = timeline_points
        options.stop_on_out_of_memory = True if stop_on_out_of_memory else False
        cdef shared_ptr[CAllocator] c_allocator = allocator.c_allocator
        cdef CReplay* created
        with nogil:
            created = new CReplay(c_allocator, options)
        self.c_replay.reset(created)
        self.allocator = allocator

    def __init__(self, Allocator allocator not None, timeline_points=2048,
                 stop_on_out_of_memory=True):
        refuse_second_init(self, &self.init_called)

    def __dealloc__(self):
        # Destroying the replay frees what is live and synchronizes the device.
        with nogil:
            self.c_replay.reset()

    cdef CReplay* get(self) except NULL:
        # Unreachable from Python (__cinit__ builds the engine or raises): a guard for C code.
        if not self.c_replay:
            raise RuntimeError("Replay is not initialized")
        return self.c_replay.get()

    def feed(self, batch):
        """Replays the events of ``batch`` (a NumPy array of
        :data:`vmalloc.traces.events.EVENT_DTYPE`). Returns False once the run has stopped
        because it ran out of memory; later batches are then ignored. A batch holding an op
        other than ALLOC or FREE raises :class:`vmalloc.InvalidArgumentError` before any of
        it is replayed."""
        arr = np.asarray(batch)
        if arr.dtype != EVENT_DTYPE:
            if arr.dtype.names != EVENT_DTYPE.names:
                raise InvalidArgumentError(
                    f"a trace batch must be an array of vmalloc.traces.events.EVENT_DTYPE, "
                    f"got dtype {arr.dtype}")
            arr = arr.astype(EVENT_DTYPE)
        arr = np.ascontiguousarray(arr.reshape(-1))
        cdef size_t n = arr.shape[0]
        cdef CReplay* r = self.get()
        cdef bool going
        if n == 0:
            with nogil:
                going = not r.stopped()
            return going
        cdef const unsigned char[::1] raw = arr.view(np.uint8)
        cdef const TraceEvent* events = <const TraceEvent*>&raw[0]
        with nogil:
            going = r.feed(events, n)
        return going

    @property
    def stopped(self):
        """True once the run stopped at an allocation that ran out of memory."""
        cdef CReplay* r = self.get()
        cdef bool stopped
        with nogil:
            stopped = r.stopped()
        return stopped

    def counts(self):
        """What the engine observed, as a dict: ``events``, ``allocations``, ``frees``,
        ``unknown_frees``, ``reused_addresses`` (allocs of a still-live trace address),
        ``out_of_memory_count``, ``out_of_memory_event`` (index of the first allocation that
        ran out, or None), ``out_of_memory_request_bytes``, ``live_allocations``,
        ``requested_bytes``, ``peak_requested_bytes`` and ``streams``."""
        cdef CReplay* r = self.get()
        cdef ReplayCounts c
        with nogil:
            c = r.counts()
        return {
            "events": c.events,
            "allocations": c.allocations,
            "frees": c.frees,
            "unknown_frees": c.unknown_frees,
            "reused_addresses": c.reused_addresses,
            "out_of_memory_count": c.out_of_memory_count,
            "out_of_memory_event": None if c.out_of_memory_event < 0 else c.out_of_memory_event,
            "out_of_memory_request_bytes": c.out_of_memory_request_bytes,
            "live_allocations": c.live_allocations,
            "requested_bytes": c.requested_bytes,
            "peak_requested_bytes": c.peak_requested_bytes,
            "streams": c.streams,
        }

    def timeline(self):
        """The downsampled timeline as three NumPy uint64 arrays ``(first_event,
        requested_bytes, reserved_bytes)``: bucket ``i`` covers the events from
        ``first_event[i]`` on, and holds the largest requested and reserved byte counts seen
        after any of them."""
        cdef CReplay* r = self.get()
        cdef vector[TimelinePoint] points
        with nogil:
            points = r.timeline()
        cdef size_t n = points.size()
        cdef size_t i
        first = np.empty(n, dtype=np.uint64)
        requested = np.empty(n, dtype=np.uint64)
        reserved = np.empty(n, dtype=np.uint64)
        cdef uint64_t[::1] f = first
        cdef uint64_t[::1] q = requested
        cdef uint64_t[::1] s = reserved
        for i in range(n):
            f[i] = points[i].first_event
            q[i] = points[i].requested_bytes
            s[i] = points[i].reserved_bytes
        return first, requested, reserved

    @property
    def timeline_stride(self):
        """Events per timeline bucket now (a power of two)."""
        cdef CReplay* r = self.get()
        cdef uint64_t stride
        with nogil:
            stride = r.timeline_stride()
        return stride
