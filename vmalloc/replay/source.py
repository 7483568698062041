"""The events a replay reads: :class:`TraceSource`, readable as many times as the
minimum-capacity search needs, from a trace file, a trace object or arrays of events."""

import os
import time
from pathlib import Path

import numpy as np

from vmalloc.errors import InvalidArgumentError
from vmalloc.traces.events import BATCH_EVENTS, EVENT_DTYPE

#: Traces up to this many events are kept in memory after their first read, so that the
#: bisection's probes do not parse the file again (32 bytes an event: 128 MiB).
CACHE_EVENTS = 1 << 22


#: Trace formats that record several devices, and so say which one was replayed.
_MULTI_DEVICE_FORMATS = ("kineto", "torch_snapshot")


class TraceSource:
    """Events to replay, readable as many times as the bisection needs.

    ``source`` is a trace file path (read with :func:`vmalloc.traces.open_trace` with
    ``format``, ``device`` and ``before_window``), a trace
    object with a ``batches()`` method, a NumPy array of
    :data:`~vmalloc.traces.events.EVENT_DTYPE`, or a list of such arrays. Traces of at most
    :data:`CACHE_EVENTS` events are kept in memory after their first read.
    """

    def __init__(self, source, name=None, format=None, device="auto", before_window="auto"):
        self._trace = None
        self._cached = None
        self.total_events = None
        #: The device whose events are replayed (``"cuda:1"``), None when not a trace file.
        self.device = None
        #: Seconds spent reading and parsing the file, in all passes so far.
        self.reading_seconds = 0.0
        self._reading_at_start = 0.0
        #: Seconds one complete pass over the file took to read (None until one finished;
        #: 0 for events in memory).
        self.read_seconds = None
        if isinstance(source, (str, os.PathLike)):
            from vmalloc.traces import open_trace

            path = Path(source)
            self._trace = open_trace(path, format=format, device=device,
                                     before_window=before_window)
            self.name = name or _trace_name(path)
            if self._trace.format in _MULTI_DEVICE_FORMATS:  # the others do not say
                self.device = self._trace.device
        elif isinstance(source, np.ndarray):
            batch = _as_events(source)
            self._cached = [batch[i:i + BATCH_EVENTS] for i in range(0, len(batch), BATCH_EVENTS)]
            self.total_events = len(batch)
            self.name = name or "events"
        elif hasattr(source, "batches"):
            self._trace = source
            if getattr(source, "format", None) in _MULTI_DEVICE_FORMATS:
                self.device = getattr(source, "device", None)
            path = getattr(source, "path", None)
            self.name = name or getattr(source, "name", None) or (
                _trace_name(Path(path)) if path else "trace")
        elif isinstance(source, (list, tuple)):
            self._cached = [_as_events(b) for b in source]
            self.total_events = sum(len(b) for b in self._cached)
            self.name = name or "events"
        else:
            raise InvalidArgumentError(
                f"cannot replay a {type(source).__name__}: give a trace path, a trace, or an "
                "array of vmalloc.traces.events.EVENT_DTYPE")
        if self.total_events is None:
            # Formats that record their length say so up front (a progress bar's total).
            value = getattr(getattr(self._trace, "info", None), "events", None)
            if isinstance(value, int) and not isinstance(value, bool):
                self.total_events = value

    @property
    def info(self):
        """The trace's :class:`~vmalloc.traces.TraceInfo` (None for arrays of events)."""
        return getattr(self._trace, "info", None)

    def batches(self):
        """Yields the event batches, from the memory cache when there is one."""
        if self._cached is not None:
            if self.read_seconds is None:
                self.read_seconds = 0.0
            yield from self._cached
            return
        self._reading_at_start = self.reading_seconds
        kept, count = [], 0
        batches = iter(self._trace.batches())
        while True:
            # Time spent reading and parsing the file (not in the caller between batches).
            t = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                self.reading_seconds += time.perf_counter() - t
                break
            self.reading_seconds += time.perf_counter() - t
            batch = _as_events(batch)
            count += len(batch)
            if kept is not None:
                if count <= CACHE_EVENTS:
                    kept.append(batch.copy())
                else:
                    kept = None
            yield batch
        self.total_events = count
        self.read_seconds = self.reading_seconds - self._reading_at_start
        if kept is not None:
            self._cached = kept


def _trace_name(path):
    name = path.name
    for suffix in (".gz", ".pickle", ".pkl", ".json", ".csv", ".vmtrace", ".log", ".txt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or str(path)


def _as_events(batch):
    arr = np.asarray(batch)
    if arr.dtype != EVENT_DTYPE:
        if arr.dtype.names != EVENT_DTYPE.names:
            raise InvalidArgumentError(
                f"trace events must be arrays of vmalloc.traces.events.EVENT_DTYPE, "
                f"got dtype {arr.dtype}")
        arr = arr.astype(EVENT_DTYPE)
    return np.ascontiguousarray(arr.reshape(-1))


def _source(trace, format=None, device="auto", before_window="auto", name=None):
    if isinstance(trace, TraceSource):
        return trace
    if trace is None:
        from vmalloc.traces import builtin_traces

        shipped = builtin_traces()
        if not shipped:
            raise InvalidArgumentError("no trace given and no built-in trace is installed")
        shipped_name, path = next(iter(sorted(shipped.items())))
        return TraceSource(path, name=name or shipped_name, format=format, device=device,
                           before_window=before_window)
    return TraceSource(trace, name=name, format=format, device=device,
                       before_window=before_window)
