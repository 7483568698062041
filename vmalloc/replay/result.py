"""What a replay reports: :class:`ReplayResult` per allocator and trace, with its
:class:`Timeline` of requested and reserved bytes."""

from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np

from vmalloc._core.stats import Stats


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
