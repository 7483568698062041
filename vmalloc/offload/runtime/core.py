"""The public :class:`Runtime`: its constructor, the driver protocol (iterations, functions,
memory) and ``stats()``. The halves it is made of live beside it: buffers and eviction
(``buffers``), recording (``recording``), following a schedule (``following``), divergence
(``divergence``)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

from vmalloc.errors import InvalidArgumentError, VmallocError
from vmalloc.offload.runtime.buffers import Buffer, FunctionPointers, Residency
from vmalloc.offload.runtime.compression import Compression
from vmalloc.offload.runtime.divergence import Divergence
from vmalloc.offload.runtime.following import Following
from vmalloc.offload.runtime.recompute import Recomputation, init_recompute_state
from vmalloc.offload.runtime.scopes import _Function, _Iteration
from vmalloc.offload.runtime.recording import Recording, warn_user
from vmalloc.sizes import parse_size

#: Device bytes left out of the budget when none is given: allocator metadata, rounding.
DEFAULT_MARGIN_FRACTION = 0.05

#: The keys every driver's ``stats()`` has (a driver may add its own): see docs/runtime.rst.
STATS_KEYS = (
    "iterations", "recorded_iterations", "scheduled_iterations", "diverged_iterations",
    "reschedules", "schedule_failures", "functions", "failed_functions",
    "on_demand_swap_ins", "evictions", "scheduled_swap_outs", "scheduled_swap_ins",
    "prefetch_failures", "over_budget", "device_bytes", "peak_device_bytes", "budget_bytes",
    "pinned_bytes", "schedule_error", "swapped_out_bytes", "swapped_in_bytes", "swap",
    "recomputed_functions", "recompute_drops", "recompute_refused", "recompute_reason")


class Runtime(Compression, Residency, Recording, Following, Divergence, Recomputation):
    """Runs a training program out of core under a device-memory budget.

    Args:
        allocator: the vmalloc allocator that holds the program's memory (the virtual
            allocator keeps pointers stable across swaps; the caching allocator relocates).
        budget: the most device bytes the program's buffers may hold at once (an int or a
            string such as ``"12GiB"``). None: the device's capacity less 5 % (no limit for a
            swap backend without a device). A budget above the device's capacity is clamped
            to the capacity, with a :class:`~vmalloc.offload.BudgetWarning`.
        scheduler: ``"window"`` (default), ``"lms"``, ``"vdnn"`` or ``"none"``, or a scheduler
            object with a ``schedule(seq)`` method.
        window: the window scheduler's byte window (default: the budget).
        stream: the compute stream (default 0, the legacy default stream).
        host_compute: True when the program computes on the host (NumPy on the emulated
            device): every wait is then a host wait. None picks True for a HostDevice.
        host_capacity: passed to the SwapManager (pinned host bytes).
        swap: an existing :class:`~vmalloc.offload.SwapManager` over ``allocator`` (or a
            swap backend with its methods) to use.
        persistent: ``"resident"`` (parameters and optimizer state stay on the device,
            counted in the budget), ``"swap"`` (the paper: they swap like the rest) or
            ``"auto"`` (default: resident if that schedule fits the budget, else swap).
        strict: raise :class:`~vmalloc.offload.ScheduleError` when no schedule fits the
            budget, instead of warning once and running on demand.
        recompute: consider recomputing (Capuchin-style) instead of swapping: a buffer written
            by functions that have a ``rerun`` (see :meth:`call`) may be dropped after its last
            use before a long gap and recomputed before its next use, when that plan fits the
            budget and moves fewer bytes (docs/runtime.rst, "Recompute").
        gpu: the GPU model (:mod:`vmalloc.offload.hardware.gpus`) whose link and compute times
            decide what is worth recomputing (default ``"v100-16gb"``, the paper's).
        compress: None (default: lossless), ``"fp16"`` or ``"bf16"``: float32 transient
            buffers are swapped in that format, half the bytes on the link, and read back
            cast to float32 (lossy; see docs/runtime.rst).
    """

    def __init__(self, allocator, budget=None, scheduler="window", window=None, stream=0,
                 host_compute=None, host_capacity=None, swap=None, persistent="auto",
                 strict=False, recompute=False, gpu=None, compress=None):
        from vmalloc._core.host_device import HostDevice

        if allocator is None and swap is None:
            raise InvalidArgumentError("a Runtime needs an allocator (or, for memory the "
                                       "framework allocates, a swap backend)")
        if persistent not in ("auto", "resident", "swap"):
            raise InvalidArgumentError(
                f"persistent must be 'auto', 'resident' or 'swap', got {persistent!r}")
        self.allocator = allocator
        self.device = allocator.device if allocator is not None else None
        capacity = self.device.capacity if self.device is not None else 0
        if budget is None:
            self.budget = int(capacity * (1 - DEFAULT_MARGIN_FRACTION)) if capacity else None
        else:
            self.budget = parse_size(budget, "budget")
            if self.budget == 0:
                raise InvalidArgumentError("budget must be positive (None: capacity - margin)")
            if capacity and self.budget > capacity:
                warn_user(f"the budget of {self.budget} bytes exceeds the device's "
                          f"capacity of {capacity} bytes; using {capacity}")
                self.budget = capacity
        self.window = None if window is None else parse_size(window, "window")
        # Bytes of the budget the window schedule leaves free (keep_free; a driver's replay).
        self.schedule_margin = 0
        if swap is None:
            from vmalloc.offload.swap import SwapManager
            swap = SwapManager(allocator, host_capacity=host_capacity)
        self.swap = swap
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
        self.persistent = persistent
        self.strict = bool(strict)
        init_recompute_state(self, recompute, gpu)
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
        self._pre_pending = False
        self._pending_out: List[Buffer] = []
        self._pending_in: List[Buffer] = []
        self._current: Optional[List[Buffer]] = None
        self._fn_name = None
        self._stats = dict(iterations=0, recorded_iterations=0, reschedules=0,
                           scheduled_iterations=0, on_demand_swap_ins=0, evictions=0,
                           diverged_iterations=0, schedule_failures=0, scheduled_swap_outs=0,
                           scheduled_swap_ins=0, prefetch_failures=0, functions=0,
                           failed_functions=0, over_budget=0, recomputed_functions=0,
                           recompute_drops=0, recompute_refused=0)
        self.last_schedule_error = None
        self._schedule_error = None        # the message said when no schedule fits
        self._schedule_need = None         # (function name, bytes) it names
        self._warned_unschedulable = False
        #: Called at every function boundary before the runtime acts: a framework driver
        #: reports the buffers it freed meanwhile (``forget``) here.
        self.at_boundary = None
        #: Why the program last departed from the record (None if it never did).
        self.last_divergence = None
        self._init_compression(compress)

    # --- iterations --------------------------------------------------------------------------
    @property
    def in_iteration(self) -> bool:
        """Whether an iteration is running."""
        return self._in_iteration

    @property
    def in_function(self) -> bool:
        """Whether a function is running."""
        return self._in_function

    def iteration(self):
        """A context manager around one training iteration."""
        return _Iteration(self)

    def begin_iteration(self) -> None:
        """An iteration starts: recorded if there is no record, else the schedule is followed
        (on demand when the budget cannot be scheduled). If it raises, no iteration runs."""
        if self._in_iteration:
            raise InvalidArgumentError("iterations do not nest")
        self._in_iteration = True
        self._iter_allocs = []
        self._iter_reruns = {}
        self._step = 0
        # Record when there is no record (first iteration, or the program changed); with a
        # record but no schedule (the budget cannot be scheduled) run on demand.
        self._recording = self._sequence is None
        self._following = self._schedule is not None and not self._recording
        self._var_of_buf = dict(self._persistent_vars)
        self._buf_of_var = {v: self._buffers[bid] for bid, v in self._persistent_vars.items()
                            if bid in self._buffers}
        if self._recording:
            self._start_record()
        elif self._following:
            self._stats["scheduled_iterations"] += 1
            try:
                self._enter_initial_state()
            except BaseException:
                self._abandon("the iteration's initial swaps failed")
                self._in_iteration = False
                raise
            self._pre_pending = True

    def end_iteration(self, failed: bool = False) -> None:
        """The iteration ends (``failed``: by an exception; its record is not used). A
        recorded iteration is scheduled here; under ``strict`` an unschedulable budget raises
        here, with the runtime usable."""
        if not self._in_iteration:
            raise InvalidArgumentError("end_iteration: no iteration is running")
        if self._in_function:
            self._in_function = False
            self._current = None
            failed = True
        self._pre_pending = False   # no function follows in this iteration
        self._in_iteration = False
        self._stats["iterations"] += 1
        recorded = self._recording and not failed
        self._recording = False
        try:
            if self._following:
                self._finish_following()
        except BaseException:
            self._diverge("the iteration's last swaps failed")
            raise
        finally:
            self._following = False
            self._iter_reruns = {}    # (its drops' only: the program's callables not kept)
        if self._rc_refused and not recorded:
            if self._sequence is not None:
                self._replan_refused()     # (a plan the runtime could not follow)
            self._rc_refused = {}     # (a record dropped meanwhile: recorded anew)
        if recorded:
            self._stats["recorded_iterations"] += 1
            self._build_schedule()

    # --- functions ---------------------------------------------------------------------------
    def function(self, reads: Iterable[Buffer] = (), writes: Iterable[Buffer] = (),
                 name: Optional[str] = None, rerun=None):
        """A context manager around one function: on entry every buffer in ``reads`` and
        ``writes`` is resident and its swap-in complete; it yields their pointers. ``rerun``:
        see :meth:`enter_function`."""
        return _Function(self, tuple(reads), tuple(writes), name, rerun)

    def enter_function(self, reads: Iterable[Buffer] = (), writes: Iterable[Buffer] = (),
                       name: Optional[str] = None, rerun=None) -> FunctionPointers:
        """A function starts: its buffers resident, their swap-ins complete; returns their
        pointers. If it raises (out of memory, a refused swap-in) no function is running and
        the runtime is usable: the rest of the iteration runs on demand.

        ``rerun``: a callable that does the function again, ``rerun(ptrs)`` with pointers as
        this returns them, reading only ``reads`` and writing only ``writes``, the same bytes
        for the same inputs. With it, the runtime may recompute what the function wrote
        instead of swapping it (``recompute=True``)."""
        reads, writes = tuple(reads), tuple(writes)
        if rerun is not None and not callable(rerun):
            raise InvalidArgumentError(f"rerun must be callable, got {rerun!r}")
        if self._in_function:
            raise InvalidArgumentError("functions do not nest")
        if self.at_boundary is not None:
            # (The driver forgets what its framework freed; a failure here fails the entry.)
            try:
                self.at_boundary()
            except BaseException as error:
                self._abandon(f"function {self._step} ({name}) failed on entry: {error!r}")
                raise
        bufs = []
        seen = set()
        for b in reads + writes:
            self._check_buffer(b, f"function {name or ''}")   # bad input: nothing changed
            if id(b) not in seen:
                seen.add(id(b))
                bufs.append(b)
        name = name or f"f{self._step}"
        try:
            if self._in_iteration:
                self._stats["functions"] += 1
                if self._following and not self._matches(self._step, name, reads, writes):
                    n = len(self._sequence.functions)
                    self._diverge(f"function {self._step} ({name}) differs from the record"
                                  if self._step < n else f"function {self._step} ({name}) "
                                  f"runs past the end of the record ({n} functions)")
                if self._pre_pending:
                    self._run_pre_actions()
            self._current = bufs
            self._in_function = True
            self._fn_reads, self._fn_writes, self._fn_name = reads, list(writes), name
            self._fn_rerun = rerun
            if self._dependents:
                self._before_writes(writes)
            self._make_resident(bufs)
        except BaseException as error:
            self._in_function = False
            self._current = None
            self._abandon(f"function {self._step} ({name}) failed on entry: {error!r}")
            raise
        return FunctionPointers(reads + writes)

    def add_writes(self, bufs: Iterable[Buffer]) -> None:
        """Outputs the running function created (a framework learns them only after the op:
        adopt them, then report them here)."""
        if not self._in_function:
            raise InvalidArgumentError("add_writes is for the running function")
        bufs = list(bufs)
        for b in bufs:
            self._check_buffer(b, "add_writes")
        for b in bufs:
            self._fn_writes.append(b)
            self._current.append(b)

    def exit_function(self, failed: bool = False) -> None:
        """The running function ends (``failed``: by an exception; then the rest of the
        iteration runs on demand and the next is recorded anew). Whatever happens here, no
        function is running afterwards."""
        if not self._in_function:
            raise InvalidArgumentError("exit_function: no function is running")
        self._in_function = False
        self._current = None
        name, rerun, self._fn_rerun = self._fn_name, self._fn_rerun, None   # (not kept)
        try:
            if self.at_boundary is not None:
                self.at_boundary()
            if not self._in_iteration:
                return
            if failed:
                self._abandon(f"function {self._step} ({name}) raised")
                return
            if rerun is not None:
                self._iter_reruns[self._step] = (rerun, tuple(self._fn_reads),
                                                 tuple(self._fn_writes))
                if self._recording:
                    self._record_rerunnable.add(len(self._record_funcs))
            if self._recording:
                self._record_funcs.append((name, self._fn_reads, tuple(self._fn_writes)))
            if self._following:
                self._post_actions(self._step)
                self._pre_pending = True
            else:
                self._enforce_budget()
            self._step += 1
        except BaseException as error:
            self._abandon(f"function {self._step} ({name}) failed on exit: {error!r}")
            raise

    # --- a context manager: the out-of-core region --------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Leaving the region: an iteration left open ends (failed if by an exception), and
        every buffer comes back to the device (:meth:`restore_all`); stats keep their values.
        Left by an exception, that exception propagates: a failure here (a buffer that cannot
        be recomputed) is a RuntimeWarning."""
        try:
            if self._in_iteration:
                self.end_iteration(failed=exc_type is not None)
            self.restore_all()
        except VmallocError as error:
            if exc_type is None:
                raise
            # The program's exception is what propagates; this one is said.
            warnings.warn(f"leaving the runtime after {exc_type.__name__}: {error}",
                          RuntimeWarning, stacklevel=2)
        return False

    # --- what the runtime did ----------------------------------------------------------------
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
        """The keys of :data:`STATS_KEYS` (see docs/runtime.rst): iterations, re-schedules,
        on-demand swap-ins, evictions, device bytes (current and peak, as the runtime counts
        its buffers), the budget, why no schedule fits (``schedule_error``, None when one
        does), and the swap backend's statistics."""
        out = dict(self._stats)
        out["device_bytes"] = self._device_bytes
        out["peak_device_bytes"] = self._peak_device_bytes
        out["budget_bytes"] = self.budget
        out["pinned_bytes"] = sum(b.footprint for b in self._buffers.values()
                                  if not b.movable)
        out["schedule_error"] = self._schedule_error
        out["recompute_reason"] = self._recompute_reason
        swap = self.swap.stats()
        out["swap"] = swap
        out["swapped_out_bytes"] = swap.get("bytes_swapped_out", 0)
        out["swapped_in_bytes"] = swap.get("bytes_swapped_in", 0)
        out.update(self._compression_stats(swap))
        return out

    # Private spellings kept for callers written before the protocol.
    _begin_iteration = begin_iteration
    _end_iteration = end_iteration
