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

from vmalloc import allocator_kinds
from vmalloc.replay._replay import Replay
from vmalloc.allocator_kinds import make_allocator
from vmalloc.errors import InvalidArgumentError
from vmalloc.replay.capacity import MAX_PROBES, _bisect, min_capacity
from vmalloc.replay.progress import reading_progress
from vmalloc.replay.report import (  # noqa: F401
    before_window_note, double_free_note, format_summary, format_table)
from vmalloc.replay.result import ReplayResult, Timeline
from vmalloc.replay.run import _add_trace_facts, replay_once
from vmalloc.replay.source import CACHE_EVENTS, TraceSource, _source, _trace_name  # noqa: F401
from vmalloc.sizes import parse_size

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
