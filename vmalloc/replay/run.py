"""One replay of a trace through one allocator on a fresh accounting-only device, and the
:class:`~vmalloc.replay.ReplayResult` it gives."""

import sys
import time

from vmalloc import allocator_kinds
from vmalloc.allocator_kinds import accounting_device, make_allocator
from vmalloc.replay._replay import Replay
from vmalloc.replay.progress import _Progress
from vmalloc.replay.result import ReplayResult, Timeline
from vmalloc.replay.source import _source
from vmalloc.sizes import parse_optional_size, parse_size


def _options(kind, chunk_size, max_split_size, policy, steal_before_create=None,
             remap_slack=None):
    """The allocator options that apply to the kind named ``kind`` (None: an allocator built
    by a callable, which takes none), parsed."""
    if kind is None:
        return {}
    return allocator_kinds.get(kind).applicable(
        chunk_size=chunk_size, max_split_size=max_split_size, policy=policy,
        steal_before_create=steal_before_create, remap_slack=remap_slack)


def _run(source, kind, capacity, granularity, options, timeline_points, progress_label=None):
    """One full replay on a fresh device. Returns (replay, allocator, device, (seconds in
    all, seconds in the engine)): reading the trace is the difference."""
    device = accounting_device(capacity, granularity)
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
