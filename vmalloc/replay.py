"""Replaying allocation traces through vmalloc's allocators, without a GPU.

A trace (a PyTorch snapshot, an RMM log, a stress pattern, ...) is replayed through each
allocator on a fresh accounting-only :class:`vmalloc.HostDevice`, event by event in C++
(:class:`Replay`). Each run gives a :class:`ReplayResult`: peaks, utilization, driver traffic,
where it ran out of memory under a capacity, and the smallest capacity that runs the whole
trace (found by bisection, each probe a full replay on a fresh device).

>>> from vmalloc.replay import replay
>>> for result in replay("snapshot.pickle"):          # doctest: +SKIP
...     print(result.allocator, result.utilization, result.min_capacity_bytes)
"""

import math
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import numpy as np

from vmalloc import allocator_kinds
from vmalloc._replay import Replay
from vmalloc.errors import InvalidArgumentError
from vmalloc.sizes import format_size, parse_optional_size, parse_size
from vmalloc.stats import Stats
from vmalloc.traces.events import BATCH_EVENTS, EVENT_DTYPE

__all__ = [
    "ALLOCATOR_KINDS",
    "ALLOCATOR_NAMES",
    "Replay",
    "ReplayResult",
    "Timeline",
    "TraceSource",
    "format_summary",
    "format_table",
    "make_allocator",
    "min_capacity",
    "replay",
    "reading_progress",
    "replay_once",
]

#: The allocator kinds :func:`replay` compares by default: every one of
#: :data:`vmalloc.allocator_kinds.KINDS` (the caching baseline, the same with PyTorch's
#: expandable segments, the virtual allocator with the paper's chunk placement, and with
#: packed placement).
ALLOCATOR_KINDS = allocator_kinds.NAMES

#: Every allocator name :func:`replay` builds.
ALLOCATOR_NAMES = ALLOCATOR_KINDS

#: Traces up to this many events are kept in memory after their first read, so that the
#: bisection's probes do not parse the file again (32 bytes an event: 128 MiB).
CACHE_EVENTS = 1 << 22

#: At most this many probes per minimum-capacity search; each is a full replay.
MAX_PROBES = 32


@dataclass(frozen=True)
class Timeline:
    """Requested and reserved bytes over a replay, downsampled to a few thousand points.

    Point ``i`` covers the events from ``events[i]`` to ``events[i + 1]`` and holds the
    largest value seen in that span, so that peaks survive the downsampling.
    """

    events: np.ndarray
    requested_bytes: np.ndarray
    reserved_bytes: np.ndarray

    def __len__(self):
        return len(self.events)


@dataclass
class ReplayResult:
    """What one allocator did with one trace.

    ``utilization`` is ``peak_requested_bytes / peak_reserved_bytes`` (1.0 is no waste at
    all; None when nothing was reserved, as in a run that stopped at its first event). ``out_of_memory_event`` is the index of the first allocation that ran out of memory
    under ``capacity_bytes``, where the run stopped (None when it completed).
    ``min_capacity_bytes`` is the smallest device capacity, in whole granules, under which the
    whole trace ran (None when not searched); ``min_capacity_exact`` tells whether one granule
    less was seen to fail (else the probe budget ran out first and it is an upper bound).
    ``min_capacity_utilization`` is the whole trace's peak requested bytes divided by
    ``min_capacity_bytes``: how much of the smallest device that works the trace really uses. Without a capacity an allocator
    may keep cached memory it would give up under pressure (the virtual allocator creates
    chunks before it remaps cached ones), so this is the fairer figure of merit.
    What the trace itself says (None when unknown, or when no pass over the whole trace
    finished): ``unmatched_frees`` and ``unmatched_free_bytes`` count the trace's frees of
    memory it never allocated (allocated before it began, or lost by the log), whatever
    ``before_window`` (``"drop"`` or ``"live"``) did with them; ``live_before_window_bytes``
    is what was replayed as live from the start (``"live"``: those frees' memory and, for
    profiler traces, the rest of PyTorch's ``Total Allocated`` at the first event);
    ``recorded_peak_allocated_bytes`` and ``recorded_peak_reserved_bytes`` are PyTorch's own
    counters at their peaks (profiler traces): what PyTorch actually reserved, to compare with
    each allocator's ``peak_reserved_bytes``.
    ``replay_seconds`` is the run's wall time without reading the trace file (so the first
    allocator, which reads it, is not charged for it); ``read_seconds`` is what one complete
    pass over the file took to read and parse (the same for every allocator of a trace; None
    when no pass finished, 0 for events in memory); ``engine_seconds`` is the part of
    ``replay_seconds`` spent in the replay engine, which ``events_per_second`` is computed
    from.
    """

    trace: str
    allocator: str
    events: int
    trace_events: Optional[int]
    completed: bool
    capacity_bytes: Optional[int]
    granularity_bytes: int
    peak_requested_bytes: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    utilization: Optional[float]
    peak_internal_fragmentation_bytes: int
    peak_live_allocations: int
    allocations: int
    frees: int
    unknown_frees: int
    reused_addresses: int
    streams: int
    out_of_memory_event: Optional[int]
    out_of_memory_request_bytes: Optional[int]
    driver_calls: int
    memory_management_calls: int
    modeled_driver_seconds: float
    driver_call_counts: dict
    replay_seconds: float
    engine_seconds: float
    events_per_second: float
    options: dict = field(default_factory=dict)
    device: Optional[str] = None
    read_seconds: Optional[float] = None
    before_window: Optional[str] = None
    unmatched_frees: Optional[int] = None
    unmatched_free_bytes: Optional[int] = None
    double_frees: Optional[int] = None
    live_before_window_bytes: Optional[int] = None
    recorded_peak_allocated_bytes: Optional[int] = None
    recorded_peak_reserved_bytes: Optional[int] = None
    min_capacity_bytes: Optional[int] = None
    min_capacity_utilization: Optional[float] = None
    min_capacity_exact: Optional[bool] = None
    min_capacity_probes: int = 0
    stats: Stats = field(default_factory=Stats, repr=False)
    timeline: Optional[Timeline] = field(default=None, repr=False)

    def to_dict(self):
        """The result as plain JSON-ready values (the timeline left out)."""
        out = {}
        for f in fields(self):
            if f.name == "timeline":
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Stats) else value
        return out


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


def make_allocator(kind, device, chunk_size=None, max_split_size=None, policy=None,
                   steal_before_create=None, remap_slack=None):
    """Builds the allocator ``kind`` on ``device``.

    ``kind`` is the name of one of :data:`vmalloc.allocator_kinds.KINDS`: ``"caching"``
    (:class:`vmalloc.CachingAllocator`, which takes ``max_split_size`` and ``policy``),
    ``"expandable-segments"`` (the same with ``expandable_segments=True``, PyTorch's
    ``expandable_segments:True``), ``"virtual"`` (:class:`vmalloc.VirtualAllocator`, which
    takes ``chunk_size`` and ``steal_before_create``), ``"virtual-packed"`` (the same with
    ``placement="packed"``, which also takes ``remap_slack``); or a callable
    ``kind(device) -> Allocator`` for anything else. Options that do not apply to the kind are
    ignored, so that one set of options serves a comparison.
    """
    if callable(kind):
        return kind(device)
    return allocator_kinds.make(kind, device, **_options(
        kind, chunk_size, max_split_size, policy, steal_before_create, remap_slack))


def _options(kind, chunk_size, max_split_size, policy, steal_before_create=None,
             remap_slack=None):
    """The allocator options that apply to the kind named ``kind`` (None: an allocator built
    by a callable, which takes none), parsed."""
    if kind is None:
        return {}
    return allocator_kinds.get(kind).applicable(
        chunk_size=chunk_size, max_split_size=max_split_size, policy=policy,
        steal_before_create=steal_before_create, remap_slack=remap_slack)


def _make_device(capacity, granularity):
    import vmalloc

    options = {"backed": False}
    if capacity is not None:
        options["capacity"] = capacity
    if granularity is not None:
        options["granularity"] = granularity
    return vmalloc.HostDevice(**options)


class _Progress:
    """A one-line progress bar on stderr, redrawn at most five times a second and erased by
    :meth:`close`. Hand-written rather than tqdm: one line, no dependency, and the few things
    needed here (events or bytes, an unknown total) are 30 lines."""

    def __init__(self, label, total, stream, unit="events"):
        self.label = label if len(label) <= 60 else label[:57] + "..."
        self.total, self.stream, self.unit = total, stream, unit
        self.last = 0.0
        self.drawn = False

    def update(self, done, force=False):
        now = time.monotonic()
        if not force and now - self.last < 0.2:
            return
        self.last = now
        count = format_size if self.unit == "bytes" else (lambda n: f"{n:,}")
        unit = "" if self.unit == "bytes" else f" {self.unit}"
        if self.total:
            frac = min(1.0, done / self.total)
            bar = "#" * int(frac * 20)
            text = f"{self.label} [{bar:<20}] {frac:6.1%} of {count(self.total)}{unit}"
        else:
            text = f"{self.label} {count(done)}{unit}"
        width = _terminal_width()
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()
        self.drawn = True

    def close(self):
        if self.drawn:
            self.stream.write("\r" + " " * _terminal_width() + "\r")
            self.stream.flush()
            self.drawn = False


def _terminal_width():
    import shutil

    return max(20, min(120, shutil.get_terminal_size((80, 24)).columns - 1))


class reading_progress:
    """A context in which reading trace files draws a progress bar of the bytes read (on
    ``stream``, default stderr): the passes that come before any event is replayed, such as
    finding a profiler trace's devices or what was live before its window."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.bar = None
        self.saved = None

    def _hook(self, path, done, total):
        if self.bar is None or self.bar.path != path:
            if self.bar is not None:
                self.bar.close()
            self.bar = _Progress(f"reading {Path(path).name}", total, self.stream, "bytes")
            self.bar.path = path
        self.bar.update(done)

    def __enter__(self):
        from vmalloc.traces import _files

        self.saved, _files.progress_hook = _files.progress_hook, self._hook
        return self

    def __exit__(self, *exc):
        from vmalloc.traces import _files

        _files.progress_hook = self.saved
        if self.bar is not None:
            self.bar.close()


def _run(source, kind, capacity, granularity, options, timeline_points, progress_label=None):
    """One full replay on a fresh device. Returns (replay, allocator, device, (seconds in
    all, seconds in the engine)): reading the trace is the difference."""
    device = _make_device(capacity, granularity)
    allocator = make_allocator(kind, device, **options)
    engine = Replay(allocator, timeline_points=timeline_points, stop_on_out_of_memory=True)
    bar = None
    hook = None
    if progress_label and source.total_events:
        # Events of a known total: a bar of events (else the bar of bytes read, if any, says
        # how far reading the file is).
        from vmalloc.traces import _files

        bar = _Progress(progress_label, source.total_events, sys.stderr)
        hook, _files.progress_hook = _files.progress_hook, None
    start = time.perf_counter()
    reading_before = getattr(source, "reading_seconds", 0.0)
    in_engine = 0.0
    try:
        for batch in source.batches():
            t = time.perf_counter()
            going = engine.feed(batch)
            in_engine += time.perf_counter() - t
            if bar:
                bar.update(engine.counts()["events"])
            if not going:
                break
    finally:
        if bar:
            bar.close()
            from vmalloc.traces import _files

            _files.progress_hook = hook
    # Reading the file is the trace's cost, not the allocator's (the first run would pay it
    # all, the others replay from memory): left out here, reported as read_seconds.
    reading = getattr(source, "reading_seconds", 0.0) - reading_before
    return engine, allocator, device, (time.perf_counter() - start - reading, in_engine)


def _passes(source, kind, capacity, granularity, options, label=None):
    if label:
        label = f"{label} probe at {format_size(capacity)}"
    engine, _, _, _ = _run(source, kind, capacity, granularity, options, 0, label)
    return not engine.stopped


def replay_once(trace, allocator="virtual", *, capacity=None, granularity=None, chunk_size=None,
                max_split_size=None, policy=None, steal_before_create=None,
                remap_slack=None, timeline_points=2048, progress=False, format=None, device="auto",
                before_window="auto", name=None):
    """Replays ``trace`` through one allocator on a fresh unbacked HostDevice.

    Args:
        trace: a path, a trace object, an array of events, or a :class:`TraceSource`.
        allocator: ``"caching"``, ``"virtual"`` or a callable ``f(device) -> Allocator``.
        capacity: device capacity (bytes or a size string); None is unlimited. The run stops
            at the first allocation that runs out of memory.
        granularity: the device's granularity (default: the device's, 2 MiB).
        chunk_size: the virtual allocator's chunk size.
        max_split_size, policy: the caching allocator's options.
        steal_before_create: the virtual allocator's option (None: its default for the
            placement; see :class:`vmalloc.VirtualAllocator`).
        remap_slack: packed placement's option (None: its default, 0).
        timeline_points: resolution of the result's :class:`Timeline` (0: none).
        progress: draw a progress bar on stderr.
        format, device, before_window: how to read a trace file
            (see :func:`vmalloc.traces.open_trace`).
        name: what to call the trace in results.

    Returns a :class:`ReplayResult` (``min_capacity_bytes`` not searched: see :func:`replay`).
    """
    source = _source(trace, format=format, device=device, before_window=before_window,
                     name=name)
    capacity = parse_optional_size(capacity, "capacity", "unlimited") or None
    granularity = parse_size(granularity, "granularity", allow_none=True)
    kind_name = allocator if isinstance(allocator, str) else None
    options = _options(kind_name, chunk_size, max_split_size, policy, steal_before_create,
                       remap_slack)
    label = f"{source.name}: {kind_name or 'allocator'}" if progress else None
    engine, alloc, dev, seconds = _run(source, allocator, capacity, granularity, options,
                                       timeline_points, label)
    result = _result(source, kind_name or alloc.name, engine, alloc, dev, seconds, capacity,
                     options)
    return _add_trace_facts(source, [result])[0]


def _trace_facts(source):
    """The ReplayResult fields that come from the trace's info (a completed pass)."""
    info = source.info
    if info is None or not getattr(info, "complete", False):
        return {}
    meta = info.metadata or {}
    live = info.before_window == "live"
    return {
        "before_window": info.before_window,
        "unmatched_frees": info.frees_before_window + info.unmatched_frees,
        "unmatched_free_bytes": info.free_before_window_bytes + info.unmatched_free_bytes,
        "double_frees": info.double_frees,
        "live_before_window_bytes": info.synthetic_alloc_bytes if live else 0,
        "recorded_peak_allocated_bytes": meta.get("recorded_peak_allocated_bytes"),
        "recorded_peak_reserved_bytes": meta.get("recorded_peak_reserved_bytes"),
    }


def _add_trace_facts(source, results):
    read = getattr(source, "read_seconds", None)
    for result in results:
        if read is not None:
            result.read_seconds = read
    for name, value in _trace_facts(source).items():
        for result in results:
            setattr(result, name, value)
    return results


def _result(source, kind, engine, allocator, device, seconds, capacity, options):
    counts = engine.counts()
    stats = allocator.stats()
    calls = device.counters()
    first, requested, reserved = engine.timeline()
    events = counts["events"]
    call_names = [k for k, v in calls.items() if isinstance(v, int) and k not in (
        "memory_management_calls", "bytes_to_device", "bytes_to_host", "bytes_device")]
    oom = counts["out_of_memory_event"]
    return ReplayResult(
        trace=source.name,
        allocator=kind,
        events=events,
        trace_events=source.total_events,
        completed=not engine.stopped,
        capacity_bytes=capacity,
        granularity_bytes=device.granularity,
        peak_requested_bytes=stats.peak_requested_bytes,
        peak_reserved_bytes=stats.peak_reserved_bytes,
        peak_allocated_bytes=stats.peak_allocated_bytes,
        # Nothing reserved (a run that stopped at its first event): no ratio to report.
        utilization=stats.utilization if stats.peak_reserved_bytes else None,
        peak_internal_fragmentation_bytes=stats.peak_internal_fragmentation_bytes,
        peak_live_allocations=stats.peak_live_allocations,
        allocations=counts["allocations"],
        frees=counts["frees"],
        unknown_frees=counts["unknown_frees"],
        reused_addresses=counts["reused_addresses"],
        streams=counts["streams"],
        out_of_memory_event=oom,
        out_of_memory_request_bytes=None if oom is None else counts["out_of_memory_request_bytes"],
        driver_calls=sum(calls[k] for k in call_names),
        memory_management_calls=calls["memory_management_calls"],
        modeled_driver_seconds=calls["modeled_seconds"],
        driver_call_counts={k: calls[k] for k in call_names if calls[k]},
        replay_seconds=seconds[0],
        read_seconds=getattr(source, "read_seconds", None),
        engine_seconds=seconds[1],
        events_per_second=events / seconds[1] if seconds[1] > 0 else 0.0,
        options=dict(options),
        device=source.device,
        stats=stats,
        timeline=Timeline(first, requested, reserved),
    )


def min_capacity(trace, allocator="virtual", *, granularity=None, chunk_size=None,
                 max_split_size=None, policy=None, steal_before_create=None,
                 remap_slack=None, max_probes=MAX_PROBES, reference=None, format=None, device="auto",
                 before_window="auto"):
    """The smallest device capacity, in whole granules, under which ``trace`` runs to the end.

    Bisection between the trace's peak requested bytes (no allocator can do with less) and
    the peak reserved bytes of an unlimited run (which then runs identically); each probe is a
    full replay on a fresh device that stops at its first out-of-memory. Allocators are not
    strictly monotone in capacity, so this is the boundary the bisection finds.

    Returns ``(capacity_bytes, exact, probes)``: ``exact`` is True when one granule less was
    seen to fail, False when ``max_probes`` ran out first (``capacity_bytes`` then still runs
    the trace, or is None when no capacity tried did). ``reference`` may be a completed
    :class:`ReplayResult` of the same trace, allocator and options without a capacity, which
    saves the unlimited run. Other arguments are as for :func:`replay_once`.
    """
    source = _source(trace, format=format, device=device, before_window=before_window)
    kind_name = allocator if isinstance(allocator, str) else None
    options = _options(kind_name, chunk_size, max_split_size, policy, steal_before_create,
                       remap_slack)
    granularity = parse_size(granularity, "granularity", allow_none=True)
    if max_probes < 1:
        raise InvalidArgumentError(f"max_probes must be at least 1, got {max_probes}")
    return _bisect(source, allocator, granularity, options, max_probes, reference)[:3]


def _bisect(source, kind, granularity, options, max_probes, reference, progress=False):
    probes = 0
    label = None
    if progress:
        label = f"{source.name}: {kind if isinstance(kind, str) else 'allocator'} min capacity"
    if reference is not None and not reference.completed and reference.capacity_bytes is None:
        return None, False, probes, reference.peak_requested_bytes
    if reference is None or not reference.completed or reference.capacity_bytes is not None:
        engine, alloc, dev, _ = _run(source, kind, None, granularity, options, 0,
                                     label and f"{label} unlimited run")
        probes += 1
        if engine.stopped:
            # Out of memory without any capacity: a request the allocator refuses whatever
            # the device (larger than it keeps books for); no capacity runs the trace.
            return None, False, probes, alloc.stats().peak_requested_bytes
        stats = alloc.stats()
        peak_requested, peak_reserved = stats.peak_requested_bytes, stats.peak_reserved_bytes
        g = dev.granularity
    else:
        peak_requested = reference.peak_requested_bytes
        peak_reserved = reference.peak_reserved_bytes
        g = reference.granularity_bytes
    if peak_requested == 0:
        return 0, True, probes, 0
    # Invariant: `hi` granules run the whole trace; `lo` granules do not (less than the peak
    # requested bytes can hold no allocator's live allocations).
    lo = math.ceil(peak_requested / g) - 1
    hi = max(lo + 1, math.ceil(peak_reserved / g))
    while True:
        if probes >= max_probes:
            # Nothing tried ran the trace within the budget.
            return None, False, probes, peak_requested
        probes += 1
        if _passes(source, kind, hi * g, granularity, options, label):
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1 and probes < max_probes:
        mid = (lo + hi) // 2
        probes += 1
        if _passes(source, kind, mid * g, granularity, options, label):
            hi = mid
        else:
            lo = mid
    return hi * g, hi - lo == 1, probes, peak_requested


def replay(trace=None, allocators=ALLOCATOR_KINDS, *, capacity=None, granularity=None,
           chunk_size=None, max_split_size=None, policy=None, steal_before_create=None,
           remap_slack=None, min_capacity=True, max_probes=MAX_PROBES, timeline_points=2048, progress=False, format=None,
           device="auto", before_window="auto", name=None):
    """Replays one trace through each allocator; returns a list of :class:`ReplayResult`.

    ``trace`` is a path, a trace object, an array of events, a :class:`TraceSource`, or None
    for the trace shipped with vmalloc (the first by name, when there are several). Each allocator runs on its own fresh unbacked
    :class:`vmalloc.HostDevice` of ``capacity`` (None: unlimited) and stops at its first
    out-of-memory. With ``min_capacity`` the smallest capacity that runs the whole trace is
    searched too, in at most ``max_probes`` replays (see :func:`min_capacity`). The other
    arguments are those of :func:`replay_once`.
    """
    if progress:
        with reading_progress():
            return _replay(trace, allocators, capacity, granularity, chunk_size,
                           max_split_size, policy, steal_before_create, remap_slack,
                           min_capacity, max_probes, timeline_points, progress, format, device,
                           before_window, name)
    return _replay(trace, allocators, capacity, granularity, chunk_size, max_split_size,
                   policy, steal_before_create, remap_slack, min_capacity, max_probes,
                   timeline_points, progress, format, device, before_window, name)


def _replay(trace, allocators, capacity, granularity, chunk_size, max_split_size, policy,
            steal_before_create, remap_slack, min_capacity, max_probes, timeline_points,
            progress, format, device, before_window, name):
    source = _source(trace, format=format, device=device, before_window=before_window,
                     name=name)
    if isinstance(allocators, str) or callable(allocators):
        allocators = [allocators]
    if not allocators:
        raise InvalidArgumentError("give at least one allocator to replay through")
    if min_capacity and max_probes < 1:
        raise InvalidArgumentError(f"max_probes must be at least 1, got {max_probes}")
    results = []
    for kind in allocators:
        result = replay_once(source, kind, capacity=capacity, granularity=granularity,
                             chunk_size=chunk_size, max_split_size=max_split_size,
                             policy=policy, steal_before_create=steal_before_create,
                             remap_slack=remap_slack, timeline_points=timeline_points, progress=progress)
        if min_capacity:
            capacity_bytes, exact, probes, peak_requested = _bisect(
                source, kind, parse_size(granularity, "granularity", allow_none=True),
                result.options, max_probes, result, progress)
            result.min_capacity_bytes = capacity_bytes
            if capacity_bytes:
                result.min_capacity_utilization = peak_requested / capacity_bytes
            result.min_capacity_exact = exact
            result.min_capacity_probes = probes
        results.append(result)
    return _add_trace_facts(source, results)


def format_table(results):
    """A readable report of results: per trace, one column per allocator."""
    rows = [
        ("events replayed", lambda r: f"{r.events:,}" + ("" if r.completed else " (stopped)")),
        ("peak requested", lambda r: format_size(r.peak_requested_bytes)),
        ("peak reserved", lambda r: format_size(r.peak_reserved_bytes)),
        ("utilization", lambda r: "-" if r.utilization is None else f"{r.utilization:.3f}"),
        ("peak internal fragmentation",
         lambda r: format_size(r.peak_internal_fragmentation_bytes)),
        ("peak live allocations", lambda r: f"{r.peak_live_allocations:,}"),
        ("driver calls: memory mgmt / all",
         lambda r: f"{r.memory_management_calls:,} / {r.driver_calls:,}"),
        ("modeled driver time", lambda r: _format_seconds(r.modeled_driver_seconds)),
        ("out of memory at",
         lambda r: "-" if r.out_of_memory_event is None else
         f"event {r.out_of_memory_event:,} ({format_size(r.out_of_memory_request_bytes)})"),
        ("min capacity that runs it", _format_min_capacity),
        ("utilization at min capacity",
         lambda r: "-" if r.min_capacity_utilization is None else
         f"{r.min_capacity_utilization:.3f}"),
    ]
    blocks = []
    traces = list(dict.fromkeys(r.trace for r in results))
    for trace in traces:
        group = [r for r in results if r.trace == trace]
        header = trace
        notes = []
        if group[0].device is not None:
            notes.append(group[0].device)
        if group[0].capacity_bytes is not None:
            notes.append(f"capacity {format_size(group[0].capacity_bytes)}")
        if notes:
            header += f" ({', '.join(notes)})"
        table = [[""] + [r.allocator for r in group]]
        table += [[label] + [fmt(r) for r in group] for label, fmt in rows]
        recorded = _recorded_column(group[0], [label for label, _ in rows])
        if recorded:
            # What PyTorch itself reserved, as its profiler recorded: the allocator the trace
            # ran under, next to what each replayed allocator would reserve.
            table[0].append("pytorch (recorded)")
            for row, cell in zip(table[1:], recorded):
                row.append(cell)

        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [header]
        for row in table:
            lines.append("  " + "  ".join(
                cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                for i, cell in enumerate(row)).rstrip())
        note = before_window_note(group[0])
        if note:
            lines.append("  " + note)
        blocks.append("\n".join(lines))
    if len(traces) > 1:
        blocks.append(format_summary(results))
    return "\n\n".join(blocks)


def format_summary(results):
    """The traces side by side (the ranks of one job, say): one row per trace, its peak
    requested bytes, then each allocator's peak reserved bytes and utilization, and PyTorch's
    recorded ones when a profiler trace has them."""
    traces = list(dict.fromkeys(r.trace for r in results))
    kinds = list(dict.fromkeys(r.allocator for r in results))
    by = {(r.trace, r.allocator): r for r in results}
    header = ["trace", "device", "peak requested"] + [f"{k} reserved (util.)" for k in kinds]
    recorded = any(r.recorded_peak_reserved_bytes is not None for r in results)
    if recorded:
        header.append("pytorch reserved (util.)")
    table = [header]
    for trace in traces:
        group = [r for r in results if r.trace == trace]
        row = [trace, group[0].device or "-",
               format_size(max(r.peak_requested_bytes for r in group))]
        for k in kinds:
            r = by.get((trace, k))
            if r is None:
                row.append("-")
                continue
            util = "-" if r.utilization is None else f"{r.utilization:.3f}"
            stopped = "" if r.completed else ", stopped"
            row.append(f"{format_size(r.peak_reserved_bytes)} ({util}{stopped})")
        if recorded:
            r = group[0]
            if r.recorded_peak_reserved_bytes is None:
                row.append("-")
            else:
                util = "-"
                if r.recorded_peak_allocated_bytes is not None and r.recorded_peak_reserved_bytes:
                    util = (f"{r.recorded_peak_allocated_bytes / r.recorded_peak_reserved_bytes:.3f}")
                row.append(f"{format_size(r.recorded_peak_reserved_bytes)} ({util})")
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["side by side"]
    for row in table:
        lines.append("  " + "  ".join(
            cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i])
            for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)


def before_window_note(r):
    """One line on the memory a trace frees without allocating it (None when it frees none
    or it is unknown)."""
    if r.unmatched_frees is None:
        return None
    text = (f"frees of memory the trace never allocated: {r.unmatched_frees:,} "
            f"({format_size(r.unmatched_free_bytes)})")
    if r.before_window == "live":
        if not r.live_before_window_bytes:
            return text if r.unmatched_frees else None
        return (text + f"; {format_size(r.live_before_window_bytes)} live before the trace "
                "began, replayed as allocated from the start")
    if not r.unmatched_frees:
        return None
    return text + "; dropped (--before-window live replays that memory from the start)"


def double_free_note(r):
    """One line on the trace's double frees (frees of memory it freed already), or None."""
    if not r.double_frees:
        return None
    return (f"double frees: {r.double_frees:,} (frees of memory the trace had freed already "
            "and not allocated again); dropped")


def _recorded_column(r, labels):
    """The cells of the "pytorch (recorded)" column for rows ``labels``, or None when the
    trace recorded no counters."""
    if r.recorded_peak_reserved_bytes is None:
        return None
    cells = {"peak reserved": format_size(r.recorded_peak_reserved_bytes)}
    if r.recorded_peak_allocated_bytes is not None:
        cells["peak requested"] = format_size(r.recorded_peak_allocated_bytes)
        if r.recorded_peak_reserved_bytes:
            cells["utilization"] = (
                f"{r.recorded_peak_allocated_bytes / r.recorded_peak_reserved_bytes:.3f}")
    return [cells.get(label, "") for label in labels]


def _format_min_capacity(r):
    if r.min_capacity_bytes is None:
        if r.min_capacity_exact is None:
            return "-"  # not searched
        if not r.completed and r.capacity_bytes is None:
            return "none (refused even unlimited)"
        return "none found"
    text = format_size(r.min_capacity_bytes)
    return text if r.min_capacity_exact else text + " (upper bound)"


def _format_seconds(seconds):
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"
