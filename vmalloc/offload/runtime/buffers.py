"""Buffers and residency: the runtime's four swap primitives, its device-byte count against the
budget, and least-recently-used eviction (on demand, and under allocation pressure)."""

from __future__ import annotations

import weakref
from typing import List, Optional

from vmalloc.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from vmalloc.offload.runtime.compression import check_kind, dtype_name
from vmalloc.sizes import parse_size


class Buffer:
    """Memory the runtime may swap. ``ptr`` is its device address while it is resident; inside
    a :meth:`Runtime.function` that lists it, it is resident and readable there.

    ``movable`` is False for memory the framework owns on a placement that relocates on a
    swap (caching, packed, small blocks): the runtime never swaps it out, since its new address
    would differ from the one the framework frees.

    ``kind`` is what the driver said it holds (:data:`~vmalloc.offload.runtime.KINDS`):
    only an ``"activation"`` may be compressed; ``"unknown"`` (the default) never is."""

    __slots__ = ("id", "nbytes", "footprint", "ptr", "persistent", "var", "alive", "where",
                 "key", "movable", "dtype", "kind", "_rt")

    def __init__(self, rt, bid, nbytes, ptr, persistent, movable=True, dtype=None,
                 kind="unknown"):
        self._rt = weakref.ref(rt)   # (the runtime holds it: no cycle, freed when dropped)
        self.id = bid
        self.nbytes = nbytes
        self.footprint = rt._footprint(nbytes)  # device bytes it takes (chunk rounding)
        self.ptr = ptr
        self.persistent = persistent
        self.var = None      # variable id in the recorded sequence
        self.alive = True
        self.where = "resident"   # resident, swapping_out, on_host, swapping_in, dropped
        self.key = ptr            # the swap manager's key while out (ptr, or a host handle)
        self.movable = movable
        self.dtype = dtype        # its elements' dtype as the driver said ("float32"), or None
        self.kind = kind

    @property
    def runtime(self):
        """The :class:`~vmalloc.offload.Runtime` that tracks it (None once that is gone)."""
        return self._rt()

    @property
    def state(self) -> str:
        """``"resident"``, ``"swapping_out"``, ``"on_host"``, ``"swapping_in"``, ``"dropped"``
        (released, to be recomputed) or ``"freed"``."""
        return self.where if self.alive else "freed"

    def __repr__(self):
        kind = "persistent" if self.persistent else "transient"
        return f"<Buffer {self.id} {kind} {self.nbytes} bytes at {self.ptr:#x} {self.state}>"


class FunctionPointers(tuple):
    """The device addresses of a function's buffers: reads then writes, in the order given;
    ``ptrs[buffer]`` looks one up by buffer."""

    __slots__ = ()

    def __new__(cls, buffers):
        return super().__new__(cls, [b.ptr for b in buffers])

    def __getitem__(self, key):
        if isinstance(key, Buffer):
            if not key.alive:
                raise InvalidPointerError(f"buffer {key.id} was deallocated")
            return key.ptr
        return tuple.__getitem__(self, key)


class Residency:
    """The residency half of :class:`~vmalloc.offload.Runtime` (a mixin)."""

    # --- public: memory ----------------------------------------------------------------------------
    def allocate(self, nbytes, dtype=None, kind="unknown") -> Buffer:
        """Device memory the runtime may swap. Outside an iteration it is persistent
        (parameters, optimizer state: allocate once); inside, transient (activations).
        ``dtype`` (optional): its elements' dtype; ``kind``: what it holds (see
        :meth:`set_kind`); only float32 activations may be compressed."""
        n = parse_size(nbytes, "nbytes")
        check_kind(kind)
        if n == 0:
            raise InvalidArgumentError("nbytes must be positive")
        if self._pre_pending:
            self._run_pre_actions()
        ptr = self._allocate_with_eviction(self._footprint(n), n)
        buf = Buffer(self, self._next_id, n, ptr, persistent=not self._in_iteration,
                     dtype=dtype_name(dtype), kind=kind)
        self._next_id += 1
        self._buffers[buf.id] = buf
        self._track(buf)
        if self._in_iteration:
            self._note_transient(buf)
        return buf

    def adopt(self, ptr: int, nbytes, persistent: Optional[bool] = None,
              dtype=None, kind="unknown") -> Buffer:
        """A buffer for memory the framework allocated itself (a PyTorch storage). Inside an
        iteration it is transient unless ``persistent`` says otherwise; the framework frees
        it, and calls :meth:`forget` once it has. Memory the runtime does not own is never
        relocated: where a swap would move it (caching, packed, small blocks) the buffer is
        tracked but stays resident (``movable`` False; ``stats()["pinned_bytes"]``).
        ``dtype``, ``kind``: as for :meth:`allocate`."""
        n = parse_size(nbytes, "nbytes")
        check_kind(kind)
        if persistent is None:
            persistent = not self._in_iteration
        try:
            movable = not self._relocates(ptr, n)
        except InvalidPointerError as error:
            raise InvalidPointerError(f"adopt: {ptr:#x} is not a live allocation of the "
                                      f"runtime's allocator ({error})") from error
        buf = Buffer(self, self._next_id, n, ptr, persistent=bool(persistent), movable=movable,
                     dtype=dtype_name(dtype), kind=kind)
        self._next_id += 1
        self._buffers[buf.id] = buf
        self._track(buf)
        if self._in_iteration and not persistent:
            self._note_transient(buf)
        elif persistent and self._in_iteration and self._recording:
            self._record_persistent.append(buf)
        return buf

    def _relocates(self, ptr, n):
        """Whether a swap of the allocation at ptr would change its pointer."""
        relocates = getattr(self.swap, "relocates", None)
        if relocates is not None:
            return bool(relocates(ptr))
        a = self.allocator
        if a is None:
            return False    # a swap backend without an allocator keeps pointers (poison)
        if not hasattr(a, "small_threshold"):
            return True     # the caching allocator
        return getattr(a, "placement", "chunks") != "chunks" or n <= a.small_threshold

    def forget(self, buf: Buffer, freed: bool = False) -> None:
        """Stops tracking an adopted buffer. ``freed=True``: its owner (the framework) has freed
        the memory, so a host copy is only dropped (the backend's ``discard``). Otherwise the
        memory still belongs to its owner with its bytes: a buffer on the host is swapped back
        in first, whatever the backend, so no data is lost."""
        if not isinstance(buf, Buffer) or buf._rt() is not self:
            raise InvalidArgumentError(f"forget: {buf!r} is not a buffer of this runtime")
        if not buf.alive:
            return
        if self._dropped or self._dependents:
            if buf.where == "dropped" and not freed:
                self._recompute_now(buf)    # the owner keeps the memory, with its bytes
            self._before_free(buf, freed=freed)
        if buf.where == "swapping_in":
            self._wait(buf)
        if buf.where in ("on_host", "swapping_out"):
            discard = getattr(self.swap, "discard", None)
            if freed and discard is not None:
                discard(buf.key)
            else:
                if buf.where == "swapping_out":
                    self._wait(buf)
                self._in(buf)         # ignores the budget: the memory leaves the runtime
                self._wait(buf)
        self._drop(buf)

    def _drop(self, buf):
        for pending in (self._pending_out, self._pending_in):
            if buf in pending:
                pending.remove(buf)
        v = self._var_of_buf.pop(buf.id, None)
        if v is not None and self._buf_of_var.get(v) is buf:
            del self._buf_of_var[v]
        self._untrack(buf)
        buf.alive = False
        self._buffers.pop(buf.id, None)

    def deallocate(self, buf: Buffer) -> None:
        """Frees a buffer in any state (waits for its copies in flight)."""
        self._check_buffer(buf, "deallocate")
        if self._in_function and self._current is not None and buf in self._current:
            raise InvalidArgumentError(
                f"buffer {buf.id} is in use by the running function; free it after the function")
        if self._dropped or self._dependents:
            self._before_free(buf)
        self.swap.deallocate(buf.key if buf.where in ("on_host", "swapping_out") else buf.ptr,
                             stream=self.stream)
        self._drop(buf)

    def buffers(self) -> List[Buffer]:
        return list(self._buffers.values())

    # --- public: allocation pressure, restore --------------------------------------------
    def make_room(self, nbytes) -> bool:
        """Allocation pressure: evicts least recently used buffers (never the running
        function's, never unmovable ones) until ``nbytes`` more fit under the budget or nothing
        is left to evict. Returns whether they fit. A driver calls it before an allocation the
        runtime does not make itself (a framework's own allocator), so that on-demand
        iterations stay within the budget too."""
        n = int(nbytes)
        if n < 0:
            raise InvalidArgumentError(f"make_room: nbytes must be >= 0, got {n}")
        footprint = self._footprint(n) if n else 0
        while not self._fits(footprint):
            if not self._evict_one():
                return False
        return True

    def restore_all(self) -> None:
        """Every live buffer resident, every copy in flight completed, whatever the budget
        (which is left as it is: ``stats()["budget_bytes"]`` keeps its value). For a driver
        leaving out-of-core mode. A dropped buffer that cannot be recomputed stays dropped (the
        others still come back) and its RecomputeError is raised."""
        if self._in_function:
            raise InvalidArgumentError("restore_all: a function is running")
        self._pending_out.clear()
        self._pending_in.clear()
        try:
            self._recompute_all()    # a RecomputeError after the swap-ins: the rest comes back
        finally:
            for buf in list(self._buffers.values()):
                if buf.where == "swapping_out":
                    self._wait(buf)
                if buf.where == "on_host":
                    self._in(buf)
                if buf.where == "swapping_in":
                    self._wait(buf)

    # --- the four swap primitives ----------------------------------------------------------
    # The runtime keeps each buffer's state itself: a relocated buffer's old address may be
    # handed to another allocation while it is on the host.
    def _out(self, buf):
        """Issues buf's swap-out (resident -> swapping_out)."""
        key = self.swap.swap_out(buf.ptr, stream=self.stream)
        buf.key = buf.ptr if key is None else key
        buf.where = "swapping_out"

    def _wait(self, buf):
        """Completes buf's copy in flight: a swap-out frees its memory, a swap-in is usable."""
        if buf.where == "swapping_out":
            self.swap.wait(buf.key, stream=self.stream)
            buf.where = "on_host"
            self._untrack(buf)
        elif buf.where == "swapping_in":
            self.swap.wait(buf.ptr, stream=self.stream)
            if self.host_compute:
                # The program reads on the host: the copy must be done, not only ordered
                # before the compute stream's next work.
                self.device.synchronize_stream(self.stream)
            buf.where = "resident"

    def _in(self, buf):
        """Issues buf's swap-in (on_host or swapping_out -> swapping_in or resident); raises
        OutOfMemoryError with nothing changed."""
        was = buf.where
        buf.ptr = self.swap.swap_in(buf.key, stream=self.stream)
        buf.key = buf.ptr
        buf.where = self.swap.state(buf.ptr)
        if was == "on_host":
            self._track(buf)

    # --- bookkeeping -----------------------------------------------------------------------
    def _check_buffer(self, buf, what):
        if not isinstance(buf, Buffer) or buf._rt() is not self:
            raise InvalidArgumentError(f"{what}: {buf!r} is not a buffer of this runtime")
        if not buf.alive:
            raise InvalidPointerError(f"{what}: buffer {buf.id} was deallocated")

    def _track(self, buf):
        self._lru[buf.id] = buf
        self._lru.move_to_end(buf.id)
        self._device_bytes += buf.footprint
        if self._device_bytes > self._peak_device_bytes:
            self._peak_device_bytes = self._device_bytes

    def _untrack(self, buf):
        if self._lru.pop(buf.id, None) is not None:
            self._device_bytes -= buf.footprint

    def _fits(self, n):
        return self.budget is None or self._device_bytes + n <= self.budget

    # --- eviction --------------------------------------------------------------------------
    def _allocate_with_eviction(self, footprint, n):
        """Allocates n bytes (``footprint`` on the device), evicting least recently used
        buffers to stay in budget."""
        return self._with_room(footprint, lambda: self.swap.allocate(n, stream=self.stream))

    def _with_room(self, footprint, acquire):
        """Runs ``acquire()`` (which takes ``footprint`` device bytes) once they fit under the
        budget, evicting least recently used buffers first and again after an
        OutOfMemoryError; returns its result."""
        while True:
            if self._fits(footprint):
                try:
                    return acquire()
                except OutOfMemoryError:
                    if not self._evict_one():
                        raise
                    continue
            if not self._evict_one():
                # What is left is the running function's: over the budget if the device has
                # room (said once), else the allocator's OutOfMemoryError.
                self._over_budget(footprint)
                return acquire()

    def _evict_one(self):
        """Swaps out (synchronously) the least recently used buffer that the running function
        does not need; completes in-flight swap-outs first. False if nothing can go."""
        if self._pending_out:
            self._complete_swap_outs(self._pending_out[:1])
            return True
        keep = set(id(b) for b in self._current) if self._current else ()
        for buf in self._lru.values():
            if id(buf) in keep or not buf.movable:
                continue
            self._wait(buf)
            self._out(buf)
            self._wait(buf)
            self._stats["evictions"] += 1
            return True
        return False

    def _enforce_budget(self):
        """After a function: evict least recently used buffers until within the budget."""
        while self.budget is not None and self._device_bytes > self.budget:
            if not self._evict_one():
                break

    def _complete_swap_outs(self, bufs):
        for buf in bufs:
            if buf.alive and buf.where == "swapping_out":
                self._wait(buf)
            try:
                self._pending_out.remove(buf)
            except ValueError:
                pass

    def _swap_in(self, buf, on_demand):
        """Issues buf's swap-in; evicts to make room. Returns False (prefetch only) when no
        room can be made."""
        if buf.where == "swapping_out":
            # Cancelled swap-out: the device copy is still there; swap_in keeps it.
            if buf in self._pending_out:
                self._pending_out.remove(buf)
            self._in(buf)
            return True
        if buf.where != "on_host":
            return True
        while True:
            if self._fits(buf.footprint):
                try:
                    self._in(buf)
                    break
                except OutOfMemoryError:
                    if not on_demand or not self._evict_one():
                        if on_demand:
                            raise
                        return False
                    continue
            if not on_demand:
                return False
            if not self._evict_one():
                self._over_budget(buf.footprint)
                self._in(buf)     # the allocator's OutOfMemoryError if the device is full
                break
        if on_demand:
            self._stats["on_demand_swap_ins"] += 1
        return True

    def _over_budget(self, nbytes):
        """Nothing is left to evict but the running function's buffers: the budget cannot be
        kept for this function. Counted, and said once (with the unschedulable budget)."""
        self._stats["over_budget"] += 1
        held = self._device_bytes + nbytes
        what = self.running_function() or "an allocation outside functions"
        message = (f"{what} needs {held} bytes on the device at once; the budget is "
                   f"{self.budget} bytes: it runs over the budget")
        if self._schedule_error is None:
            self._schedule_error = message
        self.say_budget(message)

    def _make_resident(self, bufs):
        """Every buffer of the running function resident, its swap-in waited."""
        for buf in bufs:
            if buf.where == "dropped":
                self._recompute_now(buf)
            if buf.where != "resident":
                if buf.where != "swapping_in":
                    self._swap_in(buf, on_demand=True)
                if buf.where == "swapping_in":
                    self._wait(buf)
                    if buf in self._pending_in:
                        self._pending_in.remove(buf)
            self._lru.move_to_end(buf.id)
