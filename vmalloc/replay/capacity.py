"""The smallest device capacity that runs a trace: a bisection whose every probe is a full
replay on a fresh device."""

import math

from vmalloc.errors import InvalidArgumentError
from vmalloc.replay.run import _options, _run
from vmalloc.replay.source import _source
from vmalloc.sizes import format_size, parse_size

#: At most this many probes per minimum-capacity search; each is a full replay.
MAX_PROBES = 32


def _passes(source, kind, capacity, granularity, options, label=None):
    if label:
        label = f"{label} probe at {format_size(capacity)}"
    engine, _, _, _ = _run(source, kind, capacity, granularity, options, 0, label)
    return not engine.stopped


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
