"""What a reader learned about a trace: its metadata and the counters of one full pass."""

from dataclasses import asdict, dataclass, field
from typing import Dict, Optional


@dataclass
class TraceInfo:
    """Metadata and counters of a trace (:attr:`vmalloc.traces.Trace.info`).

    Counters describe the events the reader *yielded* in its last complete pass over the
    trace; before one has finished, only what the file states up front is set (``events`` is
    then ``None`` unless the format records it, as ``.vmtrace`` does) and ``complete`` is
    False.

    Attributes:
        path: the trace file.
        format: ``"torch_snapshot"``, ``"kineto"``, ``"rmm_csv"`` or ``"vmtrace"``.
        device: the device whose events are read (``"cuda:0"``, ``"cpu"``, ...).
        before_window: how memory allocated before the recorded window is handled
            (``"drop"`` or ``"live"``; see :func:`vmalloc.traces.open_trace`).
        complete: True once a pass over the whole trace has finished.
        events: events yielded (allocs + frees, synthetic ones included).
        allocs: ALLOC events yielded.
        frees: FREE events yielded.
        alloc_bytes: sum of the sizes of all ALLOC events.
        largest_alloc_bytes: the largest ALLOC.
        peak_live_bytes: the largest sum of live allocation sizes at any point (what the job
            itself asked for at its peak: a lower bound for any allocator's reserved memory).
        live_at_end: allocations still live at the end of the trace.
        live_at_end_bytes: their total size.
        streams: number of distinct streams.
        unmatched_frees: frees of addresses not live at that point (their allocation was
            before the window, or the log lost it); dropped.
        unmatched_free_bytes: the sizes those frees named.
        double_frees: frees of an address the trace allocated and freed already, not
            allocated again since (a double free in the log); dropped, and not counted in
            ``unmatched_frees``.
        synthetic_allocs: ALLOC events added at the start for memory live before the window
            (``before_window="live"`` only).
        synthetic_alloc_bytes: their total size.
        frees_before_window: frees in the trace of memory allocated before it (frees of the
            synthetic ALLOCs; ``before_window="live"`` only: with ``"drop"`` they are
            ``unmatched_frees``).
        free_before_window_bytes: their total size.
        implicit_frees: FREE events added because an address was allocated again while live
            (the log lost its free).
        free_size_mismatches: frees naming a size other than the allocation's (the
            allocation's size is used).
        skipped: records read but not turned into events, by reason (``"oom"``,
            ``"segment_alloc"``, ``"allocate failure"``, ``"zero-size alloc"``, ...).
        metadata: format-specific facts (allocator settings of a snapshot, the header of a
            ``.vmtrace``, ...).
    """

    path: str
    format: str
    device: str = "cuda:0"
    before_window: str = "drop"
    complete: bool = False
    events: Optional[int] = None
    allocs: int = 0
    frees: int = 0
    alloc_bytes: int = 0
    largest_alloc_bytes: int = 0
    peak_live_bytes: int = 0
    live_at_end: int = 0
    live_at_end_bytes: int = 0
    streams: int = 0
    unmatched_frees: int = 0
    unmatched_free_bytes: int = 0
    double_frees: int = 0
    synthetic_allocs: int = 0
    synthetic_alloc_bytes: int = 0
    frees_before_window: int = 0
    free_before_window_bytes: int = 0
    implicit_frees: int = 0
    free_size_mismatches: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)
    metadata: Dict[str, object] = field(default_factory=dict)

    def skip(self, reason, count=1):
        """Counts ``count`` records not turned into events because of ``reason``."""
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def to_dict(self):
        """The info as a plain dict (for JSON output)."""
        return asdict(self)
