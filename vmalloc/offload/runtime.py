"""The runtime: out-of-core training of a live program, driven by a schedule.

A framework driver (or a program by hand) tells the runtime three things: which memory it may
swap (:meth:`Runtime.allocate`), where each iteration starts and ends
(:meth:`Runtime.iteration`) and which allocations each function reads and writes
(:meth:`Runtime.function`). The first iteration is *recorded* while it runs on demand; then the
runtime builds a :class:`~vmalloc.offload.FunctionSequence` from the record, schedules it (the
window scheduler by default) and, on later iterations, issues the schedule's swap-outs,
swap-ins and waits at function boundaries through a :class:`~vmalloc.offload.SwapManager`.

A program may change (a data-dependent branch, a longer or shorter iteration, a last batch of
another size). The runtime never trusts the record blindly: before every function it checks
that each listed allocation is resident and swaps in on demand what is not, evicting the least
recently used allocations when the budget or the device is full. When an iteration departs
from the record, the rest of it runs on demand, it is recorded anew, and the next iteration
runs a new schedule (``stats()["reschedules"]``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

from vmalloc.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from vmalloc.sizes import parse_size

#: Device bytes left out of the budget when none is given: allocator metadata, rounding.
DEFAULT_MARGIN_FRACTION = 0.05


class Buffer:
    """Memory the runtime may swap. ``ptr`` is its device address while it is resident; inside
    a :meth:`Runtime.function` that lists it, it is resident and readable there."""

    __slots__ = ("id", "nbytes", "footprint", "ptr", "persistent", "var", "alive", "where",
                 "key", "_rt")

    def __init__(self, rt, bid, nbytes, ptr, persistent):
        self._rt = rt
        self.id = bid
        self.nbytes = nbytes
        self.footprint = rt._footprint(nbytes)  # device bytes it takes (chunk rounding)
        self.ptr = ptr
        self.persistent = persistent
        self.var = None      # variable id in the recorded sequence
        self.alive = True
        self.where = "resident"   # resident, swapping_out, on_host, swapping_in
        self.key = ptr            # the swap manager's key while out (ptr, or a host handle)

    @property
    def state(self) -> str:
        """``"resident"``, ``"swapping_out"``, ``"on_host"``, ``"swapping_in"`` or ``"freed"``."""
        return self.where if self.alive else "freed"

    def __repr__(self):
        kind = "persistent" if self.persistent else "transient"
        return f"<Buffer {self.id} {kind} {self.nbytes} bytes at {self.ptr:#x} {self.state}>"


class FunctionPointers(tuple):
    """The device addresses of a function's buffers: reads then writes, in the order given;
    ``ptrs[buffer]`` looks one up by buffer."""

    __slots__ = ()

    def __new__(cls, buffers):
        self = super().__new__(cls, [b.ptr for b in buffers])
        return self

    def __getitem__(self, key):
        if isinstance(key, Buffer):
            if not key.alive:
                raise InvalidPointerError(f"buffer {key.id} was deallocated")
            return key.ptr
        return tuple.__getitem__(self, key)


class Runtime:
    """Runs a training program out of core under a device-memory budget.

    Args:
        allocator: the vmalloc allocator that holds the program's memory (the virtual
            allocator keeps pointers stable across swaps; the caching allocator relocates).
        budget: the most device bytes the program's buffers may hold at once (an int or a
            string such as ``"12GiB"``). None: the device's capacity less 5 %.
        scheduler: ``"window"`` (default), ``"lms"``, ``"vdnn"`` or ``"none"``, or a scheduler
            object with a ``schedule(seq)`` method.
        window: the window scheduler's byte window (default: the budget).
        stream: the compute stream (default 0, the legacy default stream).
        host_compute: True when the program computes on the host (NumPy on the emulated
            device): every wait is then a host wait. None picks True for a HostDevice.
        host_capacity: passed to the SwapManager (pinned host bytes).
        swap: an existing :class:`~vmalloc.offload.SwapManager` over ``allocator`` to use.
        persistent: ``"resident"`` (parameters and optimizer state stay on the device,
            counted in the budget), ``"swap"`` (the paper: they swap like the rest) or
            ``"auto"`` (default: resident if that schedule fits the budget, else swap).
    """

    def __init__(self, allocator, budget=None, scheduler="window", window=None, stream=0,
                 host_compute=None, host_capacity=None, swap=None, persistent="auto"):
        from vmalloc._host_device import HostDevice

        if allocator is None and swap is None:
            raise InvalidArgumentError("a Runtime needs an allocator (or, for memory the "
                                       "framework allocates, a swap backend)")
        self.allocator = allocator
        self.device = allocator.device if allocator is not None else None
        if swap is None:
            from vmalloc.offload import SwapManager
            swap = SwapManager(allocator, host_capacity=host_capacity)
        self.swap = swap
        if budget is None:
            capacity = self.device.capacity if self.device is not None else 0
            self.budget = int(capacity * (1 - DEFAULT_MARGIN_FRACTION)) if capacity else None
        else:
            self.budget = parse_size(budget, "budget")
            if self.budget == 0:
                raise InvalidArgumentError("budget must be positive (None: capacity - margin)")
        self.window = None if window is None else parse_size(window, "window")
        # Budgets and schedules count the device bytes a buffer really takes: on the virtual
        # allocator's chunk path a request is rounded up to whole chunks (the paper's exact
        # internal fragmentation), so counting requested bytes would overrun the device.
        chunk = getattr(allocator, "chunk_size", 0) if allocator is not None else 0
        small = getattr(allocator, "small_threshold", 0) if chunk else 0
        packed = getattr(allocator, "placement", "chunks") == "packed"
        if chunk and not packed:
            self._footprint = lambda n: n if n <= small else -(-n // chunk) * chunk
        else:
            self._footprint = lambda n: n
        self._scheduler_spec = scheduler
        if persistent not in ("auto", "resident", "swap"):
            raise InvalidArgumentError(
                f"persistent must be 'auto', 'resident' or 'swap', got {persistent!r}")
        self.persistent = persistent
        self.stream = stream
        self.host_compute = (isinstance(self.device, HostDevice)
                             if host_compute is None else bool(host_compute))
        self._buffers: Dict[int, Buffer] = {}
        self._next_id = 0
        # Resident (or in-flight) buffers in least-recently-used order, for on-demand eviction.
        self._lru: "OrderedDict[int, Buffer]" = OrderedDict()
        self._device_bytes = 0
        self._peak_device_bytes = 0
        # Iteration state
        self._in_iteration = False
        self._in_function = False
        self._recording = False
        self._record_funcs: List[tuple] = []
        self._record_allocs: List[Buffer] = []
        self._record_persistent: List[Buffer] = []
        self._schedule = None
        self._sequence = None
        self._persistent_vars: Dict[int, int] = {}   # buffer id -> variable (record)
        self._transient_vars: List[int] = []          # k-th allocation -> variable (record)
        self._var_of_buf: Dict[int, int] = {}         # this iteration: buffer id -> variable
        self._buf_of_var: Dict[int, Buffer] = {}      # this iteration: variable -> buffer
        self._iter_allocs: List[Buffer] = []
        self._step = 0
        self._following = False
        # The next step's actions before its function (waits for swap-outs, swap-ins) run at
        # the program's next allocate or function, not at the previous function's exit: the
        # program's frees in between come first, as the schedule's frees do.
        self._pre_pending = False
        self._pending_out: List[Buffer] = []
        self._pending_in: List[Buffer] = []
        self._current: Optional[List[Buffer]] = None
        self._stats = dict(iterations=0, recorded_iterations=0, reschedules=0,
                           scheduled_iterations=0, on_demand_swap_ins=0, evictions=0,
                           diverged_iterations=0, schedule_failures=0,
                           scheduled_swap_outs=0, scheduled_swap_ins=0,
                           prefetch_failures=0, functions=0)
        self.last_schedule_error = None
        #: Called at every function boundary before the runtime acts: a framework driver
        #: reports the buffers it freed meanwhile (``forget``) here.
        self.at_boundary = None
        #: Why the program last departed from the record (None if it never did).
        self.last_divergence = None

    # --- memory ------------------------------------------------------------------------
    def allocate(self, nbytes) -> Buffer:
        """Device memory the runtime may swap. Outside an iteration it is persistent
        (parameters, optimizer state: allocate once); inside, transient (activations)."""
        n = parse_size(nbytes, "nbytes")
        if n == 0:
            raise InvalidArgumentError("nbytes must be positive")
        if self._pre_pending:
            self._run_pre_actions()
        ptr = self._allocate_with_eviction(self._footprint(n), n)
        buf = Buffer(self, self._next_id, n, ptr, persistent=not self._in_iteration)
        self._next_id += 1
        self._buffers[buf.id] = buf
        self._track(buf)
        if self._in_iteration:
            self._note_transient(buf)
        return buf

    def adopt(self, ptr: int, nbytes, persistent: Optional[bool] = None) -> Buffer:
        """A buffer for memory the framework allocated itself (a PyTorch storage). Inside an
        iteration it is transient unless ``persistent`` says otherwise; the framework frees
        it, and calls :meth:`forget` once it has."""
        n = parse_size(nbytes, "nbytes")
        if persistent is None:
            persistent = not self._in_iteration
        buf = Buffer(self, self._next_id, n, ptr, persistent=bool(persistent))
        self._next_id += 1
        self._buffers[buf.id] = buf
        self._track(buf)
        if self._in_iteration and not persistent:
            self._note_transient(buf)
        elif persistent and self._in_iteration and self._recording:
            self._record_persistent.append(buf)
        return buf

    def forget(self, buf: Buffer) -> None:
        """The framework freed an adopted buffer: drop it (and its host copy, if any)."""
        if not buf.alive:
            return
        if buf.where == "swapping_in":
            self._wait(buf)
        if buf.where in ("on_host", "swapping_out"):
            self.swap.discard(buf.key)
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

    def _note_transient(self, buf):
        k = len(self._iter_allocs)
        self._iter_allocs.append(buf)
        if self._recording:
            self._record_allocs.append(buf)
        elif self._following and k < len(self._transient_vars):
            v = self._transient_vars[k]
            recorded = self._sequence.variables[v].nbytes
            if buf.footprint > recorded:
                # Larger than planned: the schedule's budget no longer holds.
                self._diverge(f"allocation {k} of the iteration has {buf.nbytes} bytes; the "
                              f"record has {recorded}")
                return
            self._var_of_buf[buf.id] = v
            self._buf_of_var[v] = buf

    def deallocate(self, buf: Buffer) -> None:
        """Frees a buffer in any state (waits for its copies in flight)."""
        self._check_buffer(buf, "deallocate")
        if self._in_function and self._current is not None and buf in self._current:
            raise InvalidArgumentError(
                f"buffer {buf.id} is in use by the running function; free it after the function")
        self.swap.deallocate(buf.key if buf.where in ("on_host", "swapping_out") else buf.ptr,
                             stream=self.stream)
        self._drop(buf)

    def buffers(self) -> List[Buffer]:
        return list(self._buffers.values())

    # --- iterations and functions -------------------------------------------------------
    def iteration(self):
        """A context manager around one training iteration."""
        return _Iteration(self)

    def function(self, reads: Iterable[Buffer] = (), writes: Iterable[Buffer] = (),
                 name: Optional[str] = None):
        """A context manager around one function: on entry every buffer in ``reads`` and
        ``writes`` is resident and its swap-in complete; it yields their pointers."""
        return _Function(self, tuple(reads), tuple(writes), name)

    @property
    def schedule(self):
        """The schedule later iterations follow (None before the first iteration ends, or
        when the budget cannot be scheduled)."""
        return self._schedule

    @property
    def sequence(self):
        """The recorded :class:`~vmalloc.offload.FunctionSequence` (None before recording)."""
        return self._sequence

    def stats(self) -> dict:
        """Iterations, re-schedules, on-demand swap-ins, evictions, device bytes (current and
        peak, as the runtime counts its buffers), and the swap manager's statistics."""
        out = dict(self._stats)
        out["device_bytes"] = self._device_bytes
        out["peak_device_bytes"] = self._peak_device_bytes
        out["budget_bytes"] = self.budget
        swap = self.swap.stats()
        out["swap"] = swap
        out["swapped_out_bytes"] = swap.get("bytes_swapped_out", 0)
        out["swapped_in_bytes"] = swap.get("bytes_swapped_in", 0)
        return out

    # --- internals: residency ----------------------------------------------------------
    # The four swap primitives. The runtime keeps each buffer's state itself: a relocated
    # buffer's old address may be handed to another allocation while it is on the host.
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

    def _check_buffer(self, buf, what):
        if not isinstance(buf, Buffer) or buf._rt is not self:
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

    def _allocate_with_eviction(self, footprint, n):
        """Allocates n bytes (``footprint`` on the device), evicting least recently used
        buffers to stay in budget."""
        while True:
            if self._fits(footprint):
                try:
                    return self.swap.allocate(n, stream=self.stream)
                except OutOfMemoryError:
                    if not self._evict_one():
                        raise
                    continue
            if not self._evict_one():
                raise OutOfMemoryError(
                    f"the runtime cannot make room for {n} bytes within its budget of "
                    f"{self.budget} bytes: {self._device_bytes} bytes are held by buffers the "
                    "running function needs", requested_bytes=n,
                    state=f"budget={self.budget} device_bytes={self._device_bytes}")

    def _evict_one(self):
        """Swaps out (synchronously) the least recently used buffer that the running function
        does not need; completes in-flight swap-outs first. False if nothing can go."""
        if self._pending_out:
            self._complete_swap_outs(self._pending_out[:1])
            return True
        keep = set(id(b) for b in self._current) if self._current else ()
        for bid, buf in self._lru.items():
            if id(buf) in keep:
                continue
            self._wait(buf)
            self._out(buf)
            self._wait(buf)
            self._stats["evictions"] += 1
            return True
        return False

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
                raise OutOfMemoryError(
                    f"the runtime cannot swap in buffer {buf.id} ({buf.nbytes} bytes) within "
                    f"its budget of {self.budget} bytes", requested_bytes=buf.nbytes,
                    state=f"budget={self.budget} device_bytes={self._device_bytes}")
        if on_demand:
            self._stats["on_demand_swap_ins"] += 1
        return True

    def _make_resident(self, bufs):
        """Every buffer of the running function resident, its swap-in waited."""
        for buf in bufs:
            if buf.where != "resident":
                if buf.where != "swapping_in":
                    self._swap_in(buf, on_demand=True)
                if buf.where == "swapping_in":
                    self._wait(buf)
                    if buf in self._pending_in:
                        self._pending_in.remove(buf)
            self._lru.move_to_end(buf.id)

    # --- internals: iterations ---------------------------------------------------------
    def _begin_iteration(self):
        if self._in_iteration:
            raise InvalidArgumentError("iterations do not nest")
        self._in_iteration = True
        self._iter_allocs = []
        self._step = 0
        # Record when there is no record (first iteration, or the program changed); with a
        # record but no schedule (the budget cannot be scheduled) run on demand.
        self._recording = self._sequence is None
        self._following = self._schedule is not None and not self._recording
        self._var_of_buf = dict(self._persistent_vars)
        self._buf_of_var = {v: self._buffers[bid] for bid, v in self._persistent_vars.items()
                            if bid in self._buffers}
        if self._recording:
            self._record_funcs = []
            self._record_allocs = []
            self._record_persistent = [b for b in self._buffers.values() if b.persistent]
        elif self._following:
            self._stats["scheduled_iterations"] += 1
            self._enter_initial_state()
            self._pre_pending = True

    def _enter_initial_state(self):
        """Persistent buffers where the schedule expects them when an iteration starts."""
        resident = self._schedule.initial_resident
        for buf in self._buffers.values():
            if not buf.persistent or buf.var is None:
                continue
            if buf.var in resident and buf.where != "resident":
                self._swap_in(buf, on_demand=True)
                self._wait(buf)
            elif buf.var not in resident and buf.where in ("resident", "swapping_in"):
                self._wait(buf)
                self._out(buf)
                self._pending_out.append(buf)
        self._complete_swap_outs(list(self._pending_out))

    def _end_iteration(self, failed):
        self._pre_pending = False   # no function follows in this iteration
        self._in_iteration = False
        self._stats["iterations"] += 1
        recorded = self._recording
        self._recording = False
        if self._following:
            # Outstanding swap-outs complete (the schedule's end_wait_swap_out), swap-ins too.
            self._complete_swap_outs(list(self._pending_out))
            for buf in list(self._pending_in):
                if buf.alive:
                    self._wait(buf)
            self._pending_in.clear()
            if self._step != len(self._schedule.steps):
                # Shorter than the record: the program changed.
                self._diverge(f"the iteration ended after {self._step} functions; the record "
                              f"has {len(self._schedule.steps)}")
        self._following = False
        if failed:
            return
        if recorded:
            self._stats["recorded_iterations"] += 1
            self._build_schedule()

    def _diverge(self, reason=None):
        if reason is not None:
            self.last_divergence = reason
        if self._following:
            self._stats["diverged_iterations"] += 1
            self._following = False
        # The next iteration records anew and is scheduled again.
        self._schedule = None
        self._sequence = None
        self.last_schedule_error = None

    def _build_schedule(self):
        from vmalloc.offload.sequence import FunctionSequence

        seq = FunctionSequence(name="runtime")
        var_of = {}
        for buf in self._record_persistent:
            if buf.alive:
                var_of[id(buf)] = seq.add_variable(buf.footprint, persistent=True,
                                                   name=f"b{buf.id}")
        for k, buf in enumerate(self._record_allocs):
            var_of[id(buf)] = seq.add_variable(buf.footprint, persistent=False,
                                               name=f"t{k}")
        for name, reads, writes in self._record_funcs:
            seq.add_function(inputs=[var_of[id(b)] for b in reads if id(b) in var_of],
                             outputs=[var_of[id(b)] for b in writes if id(b) in var_of],
                             name=name)
        had_schedule = self._sequence is not None or self._stats["recorded_iterations"] > 1
        self._sequence = seq
        self._persistent_vars = {buf.id: var_of[id(buf)] for buf in self._record_persistent
                                 if id(buf) in var_of}
        for buf in self._record_persistent:
            buf.var = var_of.get(id(buf))
        self._transient_vars = [var_of[id(b)] for b in self._record_allocs]
        from vmalloc.offload.schedule import ScheduleError
        modes = ["resident", "swap"] if self.persistent == "auto" else [self.persistent]
        for mode in modes:
            try:
                self._schedule = self._make_scheduler(mode).schedule(seq)
                if self.budget is not None:
                    self._schedule.check(seq, self.budget)
                self.last_schedule_error = None
                break
            except ScheduleError as error:
                # This budget cannot be scheduled (so): run on demand, which evicts as needed.
                self._schedule = None
                self.last_schedule_error = error
        if self._schedule is None:
            self._stats["schedule_failures"] += 1
        if had_schedule:
            self._stats["reschedules"] += 1

    def _make_scheduler(self, persistent):
        spec = self._scheduler_spec
        if hasattr(spec, "schedule"):
            return spec
        from vmalloc.offload.schedulers import make_scheduler
        if spec == "window":
            budget = self.budget if self.budget is not None else 1 << 62
            return make_scheduler("window", window=self.window or budget, budget=budget,
                                  persistent=persistent)
        if spec == "none":
            return make_scheduler("none")
        return make_scheduler(spec)

    def _pre_actions(self, i):
        """Step i's actions before the function: wait for swap-outs, issue swap-ins."""
        if i >= len(self._schedule.steps):
            return
        step = self._schedule.steps[i]
        if not (step.wait_swap_out or step.swap_in):
            return
        vmap = self._buf_of_var
        waits = [vmap[v] for v in step.wait_swap_out if v in vmap]
        self._complete_swap_outs(waits)
        for v in step.swap_in:
            buf = vmap.get(v)
            if buf is None or not buf.alive:
                continue
            if self._swap_in(buf, on_demand=False):
                if buf.where == "swapping_in":   # (a copy that landed already is resident)
                    self._pending_in.append(buf)
                self._stats["scheduled_swap_ins"] += 1
            else:
                self._stats["prefetch_failures"] += 1

    def _post_actions(self, i):
        """Step i's swap-outs, after the function."""
        step = self._schedule.steps[i]
        if not step.swap_out:
            return
        vmap = self._buf_of_var
        for v in step.swap_out:
            buf = vmap.get(v)
            if buf is None or not buf.alive:
                continue
            if buf.where == "swapping_in":
                self._wait(buf)
            if buf.where == "resident":
                self._out(buf)
                self._pending_out.append(buf)
                self._stats["scheduled_swap_outs"] += 1

    def _matches(self, i, name, reads, writes):
        """Whether the running function is the recorded function i."""
        if i >= len(self._sequence.functions):
            return False
        f = self._sequence.functions[i]
        if f.name != name:
            return False
        var = self._var_of_buf.get
        # Writes may grow during the function (a framework's new outputs): those known at
        # entry must begin the recorded outputs.
        return (tuple(var(b.id) for b in reads) == f.inputs
                and tuple(var(b.id) for b in writes) == f.outputs[:len(writes)])

    def _enter_function(self, reads, writes, name):
        if self._in_function:
            raise InvalidArgumentError("functions do not nest")
        if self.at_boundary is not None:
            self.at_boundary()
        bufs = []
        seen = set()
        for b in reads + writes:
            self._check_buffer(b, f"function {name or ''}")
            if id(b) not in seen:
                seen.add(id(b))
                bufs.append(b)
        name = name or f"f{self._step}"
        if not self._in_iteration:
            # Outside iterations (initialising parameters, reading results): on demand only.
            self._current = bufs
            self._in_function = True
            self._make_resident(bufs)
            return FunctionPointers(reads + writes)
        self._stats["functions"] += 1
        if self._following and not self._matches(self._step, name, reads, writes):
            self._diverge(f"function {self._step} ({name}) differs from the record")
        if self._pre_pending:
            self._run_pre_actions()
        self._current = bufs
        self._in_function = True
        self._fn_reads, self._fn_writes, self._fn_name = reads, list(writes), name
        self._make_resident(bufs)
        return FunctionPointers(reads + writes)

    def add_writes(self, bufs: Iterable[Buffer]) -> None:
        """Outputs the running function created (a framework learns them only after the op:
        adopt them, then report them here)."""
        if not self._in_function:
            raise InvalidArgumentError("add_writes is for the running function")
        for b in bufs:
            self._check_buffer(b, "add_writes")
            self._fn_writes.append(b)
            self._current.append(b)

    def _enforce_budget(self):
        """After a function: evict least recently used buffers until within the budget."""
        while self.budget is not None and self._device_bytes > self.budget:
            if not self._evict_one():
                break

    def _exit_function(self):
        self._in_function = False
        self._current = None
        if self.at_boundary is not None:
            self.at_boundary()
        if not self._in_iteration:
            return
        if self._recording:
            self._record_funcs.append((self._fn_name, self._fn_reads, tuple(self._fn_writes)))
        if not self._following:
            self._enforce_budget()
        if self._following:
            self._post_actions(self._step)
            self._step += 1
            self._pre_pending = True
        else:
            self._step += 1

    def _run_pre_actions(self):
        self._pre_pending = False
        if self._following:
            self._pre_actions(self._step)


    # --- temporary protocol aliases (dropped at merge: engine's Runtime defines them) -------
    # The public driver protocol of HELPERS.md over this Runtime's internals, so that the
    # PyTorch driver touches no private member before the rewritten runtime package lands.
    @property
    def in_iteration(self) -> bool:
        return self._in_iteration

    @property
    def in_function(self) -> bool:
        return self._in_function

    def begin_iteration(self):
        self._begin_iteration()

    def end_iteration(self, failed=False):
        self._end_iteration(failed=failed)

    def invalidate(self, reason=None):
        self._diverge(reason)

    def enter_function(self, reads=(), writes=(), name=None):
        try:
            return self._enter_function(tuple(reads), tuple(writes), name)
        except BaseException:
            # A failed entry (out of memory, a refused swap-in) runs no function.
            self._in_function = False
            self._current = None
            raise

    def exit_function(self, failed=False):
        self._exit_function()

    def restore_all(self):
        budget, self.budget = self.budget, None   # everything back, whatever the budget
        try:
            for buf in list(self._buffers.values()):
                if buf.where == "swapping_out":
                    self._wait(buf)
                if buf.where == "on_host":
                    self._swap_in(buf, on_demand=True)
                if buf.where == "swapping_in":
                    self._wait(buf)
        finally:
            self.budget = budget

    def make_room(self, nbytes) -> bool:
        n = int(nbytes)
        while self.budget is not None and self._device_bytes + n > self.budget:
            if not self._evict_one():
                return False
        return True


class _Iteration:
    __slots__ = ("rt",)

    def __init__(self, rt):
        self.rt = rt

    def __enter__(self):
        self.rt._begin_iteration()
        return self.rt

    def __exit__(self, exc_type, exc, tb):
        self.rt._end_iteration(failed=exc_type is not None)
        return False


class _Function:
    __slots__ = ("rt", "reads", "writes", "name")

    def __init__(self, rt, reads, writes, name):
        self.rt = rt
        self.reads = reads
        self.writes = writes
        self.name = name

    def __enter__(self):
        return self.rt._enter_function(self.reads, self.writes, self.name)

    def __exit__(self, exc_type, exc, tb):
        self.rt._exit_function()
        return False
