"""The simulator's parts: the copy engines and the variables' device memory.

:class:`_Engine` is one FIFO copy engine (host-to-device or device-to-host) with the
both-directions-at-once slowdown; :class:`_Memory` takes every variable's device memory
through a real vmalloc allocator and prices its driver calls. Used by
:func:`vmalloc.offload.simulate` only.
"""

from __future__ import annotations

import bisect
import math
from typing import Dict, List

import vmalloc


class _Engine:
    """A FIFO copy engine: busy intervals in order."""

    def __init__(self, bandwidth, both):
        self.bw = bandwidth
        self.both = both
        # decided once, not per copy (a plan places ~10^5 copies)
        self._instant = math.isinf(bandwidth)
        self._never_slowed = both >= bandwidth
        self.starts: List[float] = []
        self.ends: List[float] = []
        self.free_at = 0.0
        self.busy = 0.0

    def _busy_at(self, t):
        """(busy, next change) of this engine at time t."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.ends[i]:
            return True, self.ends[i]
        nxt = self.starts[i + 1] if i + 1 < len(self.starts) else math.inf
        return False, nxt

    def copy(self, ready, nbytes, other, extra=0.0):
        """Places a copy of ``nbytes`` that may start at ``ready`` (plus ``extra`` seconds on
        the engine: a compression cast); returns (start, end)."""
        free_at = self.free_at
        start = free_at if free_at > ready else ready   # max(ready, free_at), without a call
        if nbytes <= 0 or self._instant:
            end = start
        elif self._never_slowed or not other.starts:
            end = start + nbytes / self.bw
        else:
            t, left = start, float(nbytes)
            while True:
                busy, change = other._busy_at(t)
                rate = self.both if busy else self.bw
                if math.isinf(rate):
                    break
                dt = left / rate
                if t + dt <= change:
                    t += dt
                    break
                left -= (change - t) * rate
                t = change
            end = t
        end += extra
        self.starts.append(start)
        self.ends.append(end)
        self.free_at = end
        self.busy += end - start
        return start, end


class _OOM(Exception):
    pass


class _Memory:
    """Variables' device memory through a real allocator; samples for the timeline.

    Every acquire and release returns the host seconds its driver calls cost: the device's
    cost model (:meth:`vmalloc.Device.counters`, ``modeled_seconds``) prices each mapping call
    -- cuMemCreate 193 us per 2 MiB chunk, cuMemMap 1.45 us, cuMemSetAccess 36 us, cuMemUnmap
    25.6 us, cuMemAddressReserve 19 us per call (kvcached bench_vmm on an A100, as quoted in
    the project's reference numbers.md) -- so virtual addressing costs what its calls cost, per
    call and per chunk; a warm caching allocator makes no calls and pays nothing."""

    def __init__(self, alloc, seq, stable, record, device=None):
        self.alloc = alloc
        self.seq = seq
        self.nbytes = [x.nbytes for x in seq.variables]
        self._request = [max(1, n) for n in self.nbytes]   # allocate(0) would be no allocation
        self.ptr: Dict[int, int] = {}
        self.unmapped: Dict[int, int] = {}   # pointer-stable swap-out (unmap_backing)
        self.stable = stable
        self.samples = [] if record else None
        self.where = None  # (index, name) for OOM reports
        self.device = device
        # modeled_cost, not counters(): the same two figures without a 28-entry dict, read
        # around every acquire and release (a tenth of a simulation); bound once
        self._modeled = device.modeled_cost if device is not None else None
        self.va_seconds = 0.0
        self.va_calls = 0
        self._mark()

    def _mark(self):
        if self._modeled is not None:
            self._seconds, self._calls = self._modeled()

    def _cost(self):
        """Host seconds of the mapping calls since the last mark."""
        if self._modeled is None:
            return 0.0
        seconds, calls = self._modeled()
        dt = seconds - self._seconds
        self.va_calls += calls - self._calls
        self._seconds = seconds
        self._calls = calls
        self.va_seconds += dt
        return dt

    def reset_costs(self):
        self._mark()
        self.va_seconds = 0.0
        self.va_calls = 0

    def _sample(self, t):
        if self.samples is not None:
            s = self.alloc.stats()
            self.samples.append((t, s.requested_bytes, s.reserved_bytes))

    def acquire(self, v, t):
        try:
            if self.stable and v in self.unmapped:
                p = self.unmapped.pop(v)
                self.alloc.map_backing(p)
                self.ptr[v] = p
            else:
                self.ptr[v] = self.alloc.allocate(self._request[v])
        except vmalloc.OutOfMemoryError as e:
            raise _OOM(str(e)) from None
        dt = self._cost()
        if self.samples is not None:
            self._sample(t + dt)
        return dt

    def release(self, v, t, swap=False):
        p = self.ptr.pop(v, None)
        if p is None:
            return 0.0
        if swap and self.stable and self.alloc.owns_chunks(p):
            # Pointer-stable: the chunks go back to the pool, the range stays reserved.
            # (Small blocks share arena chunks: they relocate, as the SwapManager does.)
            self.alloc.unmap_backing(p)
            self.unmapped[v] = p
        else:
            self.alloc.deallocate(p)
        dt = self._cost()
        if self.samples is not None:
            self._sample(t + dt)
        return dt
