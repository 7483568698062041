"""The event model every trace reader produces and the replay engine consumes.

A trace is a sequence of events, read in batches: NumPy structured arrays of
:data:`EVENT_DTYPE`, so that readers stream in constant memory and the C++ replay loop takes
the batches without copying. The dtype is aligned: its layout is the C++ struct
``vmalloc::TraceEvent {uint8_t op; uint64_t stream, addr, size;}`` (offsets 0, 8, 16, 24;
32 bytes per event).
"""

import numpy as np

#: An allocation of ``size`` bytes that the trace knows by ``addr``.
ALLOC = 0
#: The end of the allocation known by ``addr`` (``size`` is informational, 0 if unknown).
FREE = 1

EVENT_DTYPE = np.dtype(
    [("op", np.uint8), ("stream", np.uint64), ("addr", np.uint64), ("size", np.uint64)],
    align=True,
)
assert EVENT_DTYPE.itemsize == 32

#: Events per batch a reader yields at most (constant memory whatever the trace length).
BATCH_EVENTS = 1 << 16


def empty_batch(n=0):
    """An uninitialised batch of ``n`` events."""
    return np.empty(n, dtype=EVENT_DTYPE)
