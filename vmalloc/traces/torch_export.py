"""Writing PyTorch memory snapshots: what ``torch.cuda.memory._dump_snapshot`` writes, from any
trace vmalloc reads or from vmalloc's own allocator, for PyTorch's memory viewer
(https://pytorch.org/memory_viz) and ``torch.cuda._memory_viz``.

The format (documented in ``torch.cuda.memory._snapshot``) is a pickle of a dict:

- ``device_traces``: one list per CUDA device of the allocator's actions in order, each a dict
  with ``action`` (``alloc``, ``free_requested``, ``free_completed``, ...), ``addr``, ``size``,
  ``stream`` and ``frames`` (the Python stack: empty here, a trace does not record it);
- ``segments``: the memory held when the snapshot was taken, each a dict with ``address``,
  ``total_size``, ``stream``, ``segment_type`` (``"large"`` above 1 MiB), ``segment_pool_id``,
  ``allocated_size``, ``active_size``, ``device`` and ``blocks`` (``size``,
  ``requested_size``, ``address``, ``state``, ``frames``).

Each allocation becomes an ``alloc``, each free a ``free_requested`` then a
``free_completed`` (as PyTorch records a free whose streams are done); the blocks live at the
end are the segments, one per block (a trace does not say how an allocator grouped them). Read
back by :func:`vmalloc.traces.open_trace`, the file gives the same events. The history is held
in memory while it is written, as PyTorch holds its own (``max_entries``).
"""

import os
import pickle

import numpy as np

from vmalloc.errors import InvalidArgumentError
from vmalloc.traces.events import ALLOC, FREE

__all__ = ["snapshot_from_events", "snapshot_from_trace", "allocator_snapshot",
           "write_snapshot", "LARGE_SEGMENT_BYTES", "MAX_DEVICE"]

#: PyTorch calls a segment "large" above 1 MiB (its large pool).
LARGE_SEGMENT_BYTES = 1 << 20
#: The highest CUDA ordinal a snapshot is written for: the format holds one list of actions
#: per device up to its own, so a 500-byte trace naming device 10**9 took 98 s and 2.8 GB.
MAX_DEVICE = 1023


def snapshot_from_events(batches, device=0):
    """The snapshot dict of the events in ``batches`` (arrays of
    :data:`~vmalloc.traces.events.EVENT_DTYPE`, or one array) on CUDA device ``device``."""
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidArgumentError(f"device must be a CUDA ordinal (an int >= 0), got {device!r}")
    if device > MAX_DEVICE:
        raise InvalidArgumentError(
            f"device cuda:{device}: a PyTorch snapshot holds one list of actions per device up "
            f"to its own ({device + 1:,} lists); refused above cuda:{MAX_DEVICE}")
    if isinstance(batches, np.ndarray):
        batches = [batches]
    history = []
    live = {}  # addr -> (stream, size), insertion order = allocation order
    append = history.append
    for batch in batches:
        for op, stream, addr, size in batch.tolist():
            if op == ALLOC:
                append({"action": "alloc", "addr": addr, "size": size, "stream": stream,
                        "frames": []})
                live[addr] = (stream, size)
            elif op == FREE:
                for action in ("free_requested", "free_completed"):
                    append({"action": action, "addr": addr, "size": size, "stream": stream,
                            "frames": []})
                live.pop(addr, None)
    segments = [_segment(addr, stream, size, device) for addr, (stream, size) in live.items()]
    traces = [[] for _ in range(device)] + [history]
    return {"segments": segments, "device_traces": traces}


def _segment(addr, stream, size, device):
    return {"address": addr, "total_size": size, "stream": stream,
            "segment_type": "large" if size > LARGE_SEGMENT_BYTES else "small",
            "segment_pool_id": (0, 0), "allocated_size": size, "active_size": size,
            "device": device,
            "blocks": [{"address": addr, "size": size, "requested_size": size,
                        "state": "active_allocated", "frames": []}]}


def _ordinal(device_name):
    """``"cuda:3"`` -> 3; anything else (a format of one device, ``"cpu"``) -> 0."""
    if isinstance(device_name, str) and device_name.startswith("cuda:"):
        return int(device_name.split(":", 1)[1])
    return 0


def snapshot_from_trace(path, format=None, device="auto", before_window="auto"):
    """The snapshot dict of the trace at ``path`` (any format :func:`vmalloc.traces.open_trace`
    reads, with the same arguments): the events replay would see, on the device they came
    from (``cuda:N`` stays device N)."""
    from vmalloc.traces import open_trace

    trace = open_trace(path, format=format, device=device, before_window=before_window)
    return snapshot_from_events(trace.batches(), device=_ordinal(trace.device))


def allocator_snapshot(allocator, device=0):
    """The snapshot dict of what a :class:`vmalloc.LoggingAllocator` recorded so far (its
    records are flushed to its file, which is read back). Any other allocator keeps no
    history: wrap it in a LoggingAllocator before the allocations to export."""
    from vmalloc import LoggingAllocator

    if not isinstance(allocator, LoggingAllocator):
        raise InvalidArgumentError(
            f"{type(allocator).__name__} keeps no allocation history: wrap it in "
            "vmalloc.LoggingAllocator(allocator, 'job.vmtrace') before allocating, and take "
            "the snapshot of that")
    allocator.flush()
    from vmalloc.traces import open_trace

    trace = open_trace(allocator.path, format="vmtrace", before_window="drop")
    return snapshot_from_events(trace.batches(), device=device)


def write_snapshot(snapshot, path):
    """Writes ``snapshot`` (a dict from this module) to ``path`` as ``_dump_snapshot`` does
    (a pickle); the file appears only once complete. Returns ``path``."""
    from vmalloc.traces._files import atomic_output

    path = os.fspath(path)
    with atomic_output(path) as partial:
        with open(partial, "wb") as f:
            pickle.dump(snapshot, f, protocol=4)
    return path
