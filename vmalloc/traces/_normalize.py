"""Raw allocator records -> consistent EVENT_DTYPE batches (shared by every text reader).

A foreign log is rarely self-consistent: a ring buffer loses the allocations of its oldest
frees, a profiler starts after the model's weights were allocated, a log misses a free. Every
reader hands its raw records ``(op, stream, addr, size)`` to :func:`normalized_batches`, which
yields events with these guarantees (the ``consistent`` property of a ``.vmtrace`` file):

* every FREE names an address that is live (allocated and not yet freed) and carries that
  allocation's size and the stream it is freed on;
* no ALLOC names a live address (a lost free becomes an *implicit* FREE first), none has size 0
  or address 0.

What it had to change is counted in the :class:`~vmalloc.traces.info.TraceInfo`.
"""

import numpy as np

from vmalloc.traces.events import ALLOC, BATCH_EVENTS, EVENT_DTYPE

BEFORE_WINDOW_CHOICES = ("auto", "drop", "live")

#: The formats whose ``before_window="auto"`` means ``"live"``: profiler traces record
#: PyTorch's allocated total with every event, so what was live before them is known.
LIVE_BY_DEFAULT = ("kineto",)


def make_batch(ops, streams, addrs, sizes):
    """An EVENT_DTYPE batch from four equal-length sequences (padding bytes zeroed, so a batch
    written to a file is deterministic)."""
    batch = np.zeros(len(ops), dtype=EVENT_DTYPE)
    if len(ops):
        batch["op"] = ops
        batch["stream"] = streams
        batch["addr"] = addrs
        batch["size"] = sizes
    return batch


def scan_before_window(records):
    """A first pass for ``before_window="live"``: the allocations made before the window.

    Returns ``{addr: (stream, size)}`` in order of appearance, for every address whose first
    record is a free: its allocation happened before the trace begins.
    """
    live = set()
    seen = set()
    before = {}
    for op, stream, addr, size in records:
        if addr == 0:
            continue
        if op == ALLOC:
            if size:
                live.add(addr)
                seen.add(addr)
        elif addr in live:
            live.discard(addr)
        elif addr not in seen:
            seen.add(addr)
            before[addr] = (stream, size)
    return before


#: Frees remembered for telling a double free from a free of memory never allocated: the last
#: of each of 2**RECENT_BITS slots by address hash (as src/trace/normalizer.cpp).
RECENT_BITS = 16


def _recent_slot(addr):
    return ((addr * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> (64 - RECENT_BITS)


def normalized_batches(records, info, live_before=None):
    """Yields batches of at most BATCH_EVENTS consistent events from ``records``.

    ``records`` yields ``(op, stream, addr, size)`` with op ALLOC or FREE (FREE sizes may be 0
    when the log does not know them). ``live_before``, if given, maps addresses allocated
    before the window to ``(stream, size)``: each becomes a synthetic ALLOC at the start.
    ``info`` receives the counters; ``info.complete`` is set when the records are exhausted.
    """
    live = {}  # addr -> size
    # The address of the last free that hashed to each slot, as the C++ normalizer keeps them
    # (Normalizer::recent_frees_): an address not live found here is a double free.
    recent = None
    streams_seen = set()
    ops, streams, addrs, sizes = [], [], [], []
    live_bytes = 0
    peak = 0
    largest = 0
    n_alloc = n_free = alloc_bytes = 0

    synthetic = set()  # addresses of synthetic ALLOCs not freed yet
    for addr, (stream, size) in (live_before or {}).items():
        if not size:
            info.skip("live before window, size unknown")
            continue
        live[addr] = size
        synthetic.add(addr)
        streams_seen.add(stream)
        ops.append(ALLOC)
        streams.append(stream)
        addrs.append(addr)
        sizes.append(size)
        info.synthetic_allocs += 1
        info.synthetic_alloc_bytes += size
        n_alloc += 1
        alloc_bytes += size
        largest = max(largest, size)
        live_bytes += size
        if len(ops) == BATCH_EVENTS:
            yield make_batch(ops, streams, addrs, sizes)
            ops, streams, addrs, sizes = [], [], [], []
    peak = live_bytes

    for op, stream, addr, size in records:
        if op == ALLOC:
            if size == 0:
                info.skip("zero-size alloc")
                continue
            if addr == 0:
                info.skip("alloc at address 0")
                continue
            old = live.get(addr)
            if old is not None:
                synthetic.discard(addr)
                # The log lost the free of the previous allocation at this address.
                info.implicit_frees += 1
                n_free += 1
                live_bytes -= old
                ops.append(1)
                streams.append(stream)
                addrs.append(addr)
                sizes.append(old)
                if len(ops) == BATCH_EVENTS:
                    yield make_batch(ops, streams, addrs, sizes)
                    ops, streams, addrs, sizes = [], [], [], []
            live[addr] = size
            n_alloc += 1
            alloc_bytes += size
            if size > largest:
                largest = size
            live_bytes += size
            if live_bytes > peak:
                peak = live_bytes
        else:
            if addr == 0:
                info.skip("free of address 0")
                continue
            allocated = live.pop(addr, None)
            if allocated is None:
                if recent is not None and recent[_recent_slot(addr)] == addr:
                    info.double_frees += 1  # freed already (not live since)
                    continue
                info.unmatched_frees += 1
                info.unmatched_free_bytes += size
                continue
            if recent is None:
                recent = [0] * (1 << RECENT_BITS)
            recent[_recent_slot(addr)] = addr
            if size and size != allocated:
                info.free_size_mismatches += 1
            size = allocated
            if synthetic and addr in synthetic:
                synthetic.discard(addr)
                info.frees_before_window += 1
                info.free_before_window_bytes += size
            n_free += 1
            live_bytes -= size
        if stream not in streams_seen:
            streams_seen.add(stream)
        ops.append(op)
        streams.append(stream)
        addrs.append(addr)
        sizes.append(size)
        if len(ops) == BATCH_EVENTS:
            yield make_batch(ops, streams, addrs, sizes)
            ops, streams, addrs, sizes = [], [], [], []
    if ops:
        yield make_batch(ops, streams, addrs, sizes)

    info.allocs = n_alloc
    info.frees = n_free
    info.events = n_alloc + n_free
    info.alloc_bytes = alloc_bytes
    info.largest_alloc_bytes = largest
    info.peak_live_bytes = peak
    info.live_at_end = len(live)
    info.live_at_end_bytes = live_bytes
    info.streams = len(streams_seen)
    info.complete = True
