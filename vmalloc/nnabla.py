"""Out-of-core training with nnabla: vmalloc's schedulers drive nnabla's own array swaps.

nnabla cannot take an external allocator from Python, so this adapter does what nnabla's
``nnabla.lms.SwapInOutScheduler`` does, with vmalloc's schedulers deciding:

- Iteration 1 is **recorded** through nnabla's global function and solver hooks: every
  function call (forward and backward) with the arrays (``NdArray``) it reads and writes, and
  every solver call (``update``, ``weight_decay``, ...) with the parameter, gradient and solver
  state arrays it touched. Arrays are identified by their ``NdArray`` (``hash`` is the C++
  object's address; the adapter holds a reference to each recorded array so an address is never
  reused while it is known). The record becomes a :class:`vmalloc.offload.FunctionSequence`:
  arrays the program clears itself during the iteration (``clear_buffer``,
  ``clear_no_need_grad``) are transient; every other array (parameters, gradients, solver
  state, inputs, the loss) outlives the iteration and is persistent. While recording, every
  array a function used is moved to the host after the function (nnabla's first iteration does
  the same), so the record runs within little device memory.
- The sequence is **scheduled** by a vmalloc scheduler (the window scheduler by default, with
  the budget in bytes and a look-ahead window of 1.5 x budget as nnabla's ``prefetch_size``).
- Later iterations **execute** the schedule with nnabla's own array operations at the
  function boundaries: swap-in = ``cast(dtype, device_ctx)``, swap-out = ``cast(dtype,
  host_ctx)``. A cast issued from Python is synchronous, so waits are no-ops. ``allocate`` is a
  no-op (nnabla allocates on write). ``free`` of a transient array is left to the program's
  own clear, which happens at the same boundary (clearing it early would destroy data if the
  program has changed); ``free`` of a persistent array (content dead until rewritten, e.g. a
  gradient before ``zero_grad``) moves it to the host instead, so a user who reads it after
  the iteration still sees it.
- **Iterations that differ from the record** (another function, more functions, fewer) never
  crash or corrupt: at the first function that does not match the record the adapter stops
  following the schedule and runs the rest of the iteration on demand (nnabla casts a host
  array to the device itself when a function needs it; the adapter moves each function's
  arrays back to the host after it), and the next iteration is recorded and scheduled anew.
  nnabla's own scheduler indexes its record without a bounds check and segfaults on an
  iteration longer than the recorded one.

Use it as nnabla's::

    from vmalloc.nnabla import WindowSwapScheduler
    host = nn.Context(["cpu:float"], "CpuArray", "0")
    device = nn.Context(["cpu:float"], "CpuCachedArray", "0")   # or a cudnn context
    sched = WindowSwapScheduler(host, device, budget="64MiB", solver=solver)
    for batch in data:
        with sched:
            x.d = batch
            loss.forward(clear_no_need_grad=True)
            solver.zero_grad()
            loss.backward(clear_buffer=True)
            solver.update()
    print(sched.stats())

This module imports without nnabla; using the scheduler without nnabla raises ImportError
saying what to install (nnabla's wheels exist for Python 3.8-3.10).
"""

from __future__ import annotations

import time
import warnings
from typing import Dict, List, Optional

from vmalloc.sizes import parse_size

_INSTALL_HINT = (
    "vmalloc.nnabla needs nnabla: pip install 'nnabla' 'numpy~=1.26.0' 'protobuf~=3.20' "
    "(nnabla's wheels exist only for Python 3.8-3.10)")

_HOOK_KEY = "vmalloc_nnabla_{}_{}"

# modes of an iteration
_IDLE, _RECORD, _RUN, _ON_DEMAND = "idle", "record", "run", "on_demand"


def _import_nnabla():
    try:
        import nnabla  # noqa: F401
        import nnabla.callback  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without nnabla
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return nnabla


def available() -> bool:
    """Whether nnabla can be imported here."""
    try:
        _import_nnabla()
    except ImportError:
        return False
    return True


class _Array:
    """A recorded nnabla array (``NdArray``) and what the adapter knows of it."""

    __slots__ = ("key", "arr", "nbytes", "name", "vid", "persistent", "where")

    def __init__(self, key, arr, nbytes, name):
        self.key = key
        self.arr = arr            # a reference: keeps the C++ NdArray (and its address) alive
        self.nbytes = nbytes
        self.name = name
        self.vid = None
        self.persistent = True
        self.where = None         # "host", "device" or None (unknown) as the adapter moved it


def _nbytes(arr):
    try:
        import numpy as np
        return int(arr.size) * np.dtype(arr.dtype).itemsize
    except Exception:  # noqa: BLE001 - a cleared array may have no dtype: count 4 bytes
        return int(arr.size) * 4


def _has_content(arr) -> bool:
    """Whether the array holds data worth moving (not cleared, not a pending zero-fill)."""
    try:
        return not (arr.clear_called or arr.zeroing)
    except Exception:  # noqa: BLE001
        return False


class WindowSwapScheduler:
    """Out-of-core execution of nnabla programs, scheduled by vmalloc (module docstring).

    Args:
        host_ctx: nnabla context of host memory, e.g. ``Context(['cpu:float'], 'CpuArray', '0')``.
        device_ctx: nnabla context of device memory (on a CPU-only machine
            ``Context(['cpu:float'], 'CpuCachedArray', '0')``; the device_id must be numeric).
        budget: device bytes the schedule may hold at once (int or a string such as "64MiB").
        window: the window scheduler's look-ahead in bytes; default 1.5 x budget (nnabla's
            default ``prefetch_size``).
        scheduler: "window" (default), "lms", "vdnn", "none", or an object with
            ``schedule(seq) -> Schedule``.
        solver: the nnabla solver (or a list of solvers) whose calls happen inside the
            iteration; with it, each solver call is recorded with the arrays it touched and its
            parameters are swapped like the rest. Without it solver calls are recorded as
            functions of unknown arrays (nnabla brings what they need to the device itself).
        persistent: "swap" (the paper: parameters and other persistent arrays live on the host
            between uses) or "resident" (kept on the device, counted in the budget).
        record_swap_out: move every array to the host after each function while recording
            (nnabla's first iteration does so); default True.
    """

    def __init__(self, host_ctx, device_ctx, budget, window=None, scheduler="window",
                 solver=None, persistent: str = "swap", record_swap_out: bool = True):
        _import_nnabla()
        self.host_ctx = host_ctx
        self.device_ctx = device_ctx
        self.budget = parse_size(budget, "budget")
        self.window = (parse_size(window, "window") if window is not None
                       else max(1, int(self.budget * 1.5)))
        self.scheduler = scheduler
        if solver is None:
            solvers = []
        elif isinstance(solver, (list, tuple)):
            solvers = list(solver)
        else:
            solvers = [solver]
        self.solvers = solvers
        self.persistent = persistent
        self.record_swap_out = record_swap_out
        self._key = _HOOK_KEY.format(id(self), "{}")
        self._arrays: Dict[int, _Array] = {}
        self._record: List[tuple] = []      # (signature, reads, writes, name) per function
        self._sequence = None
        self._schedule = None
        self._steps = None
        self.last_schedule_error: Optional[Exception] = None
        self.mismatch: Optional[str] = None  # why the last iteration left the schedule
        self._mode = _IDLE
        self._need_record = True
        self._pos = 0
        self._fcount: Dict[tuple, int] = {}
        self._solver_snapshot = None
        self._solver_calls = 0
        self._iter_start = 0.0
        self._stats = dict(iterations=0, recorded_iterations=0, scheduled_iterations=0,
                           on_demand_iterations=0, reschedules=0, mismatches=0,
                           schedule_failures=0, swap_in_bytes=0, swap_out_bytes=0,
                           swap_ins=0, swap_outs=0, on_demand_swap_ins=0,
                           on_demand_swap_in_bytes=0, last_iteration_seconds=0.0)
        self._iter_bytes = [0, 0]
        self.history: List[dict] = []       # per iteration: mode, bytes in/out, seconds

    # --- nnabla's API -------------------------------------------------------------------
    def start_scheduling(self):
        """Starts an iteration (``with scheduler:`` calls it) and registers the hooks."""
        import nnabla.callback as cb
        if self._mode != _IDLE:
            raise RuntimeError("start_scheduling() called twice without end_scheduling()")
        self._begin()
        cb.set_function_pre_hook(self._key.format("fpre"), self._function_pre)
        cb.set_function_post_hook(self._key.format("fpost"), self._function_post)
        cb.set_solver_pre_hook(self._key.format("spre"), self._solver_pre)
        cb.set_solver_post_hook(self._key.format("spost"), self._solver_post)

    def end_scheduling(self):
        """Ends the iteration: unregisters the hooks, finishes the schedule (or, after a
        mismatch, moves what is left on the device to the host) and, after a recording
        iteration, schedules the record."""
        import nnabla.callback as cb
        if self._mode == _IDLE:
            raise RuntimeError("end_scheduling() without start_scheduling()")
        cb.unset_function_pre_hook(self._key.format("fpre"))
        cb.unset_function_post_hook(self._key.format("fpost"))
        cb.unset_solver_pre_hook(self._key.format("spre"))
        cb.unset_solver_post_hook(self._key.format("spost"))
        self._finish()

    start = start_scheduling
    end = end_scheduling

    def __enter__(self):
        self.start_scheduling()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.end_scheduling()
        return False

    # --- results ------------------------------------------------------------------------
    @property
    def sequence(self):
        """The recorded :class:`~vmalloc.offload.FunctionSequence` (None before a record)."""
        return self._sequence

    @property
    def schedule(self):
        """The :class:`~vmalloc.offload.Schedule` being executed (None if none)."""
        return self._schedule

    def stats(self) -> dict:
        """Iterations by kind, re-schedules, mismatches, and the bytes this adapter moved
        (swap_in_bytes / swap_out_bytes: casts of arrays holding data, counted when the
        adapter moves an array it does not already know to be at the destination)."""
        out = dict(self._stats)
        out["budget_bytes"] = self.budget
        out["window_bytes"] = self.window
        if self._schedule is not None:
            out["planned_peak_bytes"] = self._schedule.planned_peak
        if self._sequence is not None:
            out["functions"] = len(self._sequence.functions)
            out["arrays"] = len(self._sequence.variables)
            out["in_core_peak_bytes"] = self._sequence.in_core_peak()
        return out

    # --- moving arrays ------------------------------------------------------------------
    def _move(self, a: _Array, to_device: bool):
        arr = a.arr
        dest = "device" if to_device else "host"
        if not _has_content(arr):
            return
        if a.where == dest:
            return
        arr.cast(arr.dtype, self.device_ctx if to_device else self.host_ctx)
        a.where = dest
        if to_device:
            self._stats["swap_ins"] += 1
            self._stats["swap_in_bytes"] += a.nbytes
            self._iter_bytes[0] += a.nbytes
        else:
            self._stats["swap_outs"] += 1
            self._stats["swap_out_bytes"] += a.nbytes
            self._iter_bytes[1] += a.nbytes

    def _array(self, arr, name) -> _Array:
        key = hash(arr)
        a = self._arrays.get(key)
        if a is None:
            a = _Array(key, arr, _nbytes(arr), name)
            self._arrays[key] = a
        return a

    def _touched(self, a: _Array, read: bool):
        """A function used the array: nnabla brought it to the device itself if it was not
        there (counted as an on-demand swap-in when the function read data from the host)."""
        if read and a.where == "host" and _has_content(a.arr):
            self._stats["on_demand_swap_ins"] += 1
            self._stats["on_demand_swap_in_bytes"] += a.nbytes
            self._stats["swap_in_bytes"] += a.nbytes
            self._iter_bytes[0] += a.nbytes
        a.where = "device"

    # --- the iteration ------------------------------------------------------------------
    def _begin(self):
        self._iter_start = time.perf_counter()
        self._iter_bytes = [0, 0]
        self._pos = 0
        self._fcount = {}
        self._solver_calls = 0
        self.mismatch = None
        if self._need_record:
            self._mode = _RECORD
            self._record = []
            self._arrays = {}
        elif self._steps is None:
            self._mode = _ON_DEMAND          # the record could not be scheduled
        else:
            self._mode = _RUN

    def _finish(self):
        mode = self._mode
        if mode == _RUN and self._pos != len(self._steps):
            self._diverge(f"shorter iteration: {self._pos} of {len(self._steps)} recorded "
                          "functions ran")
            mode = _ON_DEMAND
        if mode == _RUN:
            self._stats["scheduled_iterations"] += 1
            # end_wait_swap_out: the casts were synchronous; nothing to wait for
        else:
            # record or on demand: every known array with data goes back to the host
            for a in self._arrays.values():
                if a.where != "host":
                    self._move(a, False)
            if mode == _RECORD:
                self._stats["recorded_iterations"] += 1
                self._build()
            else:
                self._stats["on_demand_iterations"] += 1
        self._mode = _IDLE
        seconds = time.perf_counter() - self._iter_start
        self._stats["iterations"] += 1
        self._stats["last_iteration_seconds"] = seconds
        self.history.append(dict(mode=mode, swap_in_bytes=self._iter_bytes[0],
                                 swap_out_bytes=self._iter_bytes[1], seconds=seconds,
                                 mismatch=self.mismatch))

    def _diverge(self, reason):
        """The iteration left the record: on demand for the rest, record the next one."""
        self._mode = _ON_DEMAND
        self._need_record = True
        self.mismatch = reason
        self._stats["mismatches"] += 1

    # --- function hooks -----------------------------------------------------------------
    def _signature(self, f):
        outs = tuple(hash(v.data) for v in f.outputs)
        ins = tuple(hash(v.data) for v in f.inputs)
        base = (f.name, ins, outs)
        n = self._fcount.get(base, 0)
        self._fcount[base] = n + 1
        return base + (n,)           # n = 0: forward; 1: backward; more: called again

    def _function_pre(self, f):
        mode = self._mode
        if mode == _RUN:
            sig = self._signature(f)
            i = self._pos
            if i >= len(self._steps):
                self._diverge(f"longer iteration: function {f.name} after the "
                              f"{len(self._steps)} recorded functions")
                return
            if self._record[i][0] != sig:
                self._diverge(f"function {i} is {f.name}, not the recorded "
                              f"{self._record[i][3]}")
                return
            self._pre_actions(i)
        elif mode == _RECORD:
            sig = self._signature(f)
            reads, writes = self._uses(f, sig[-1] > 0)
            self._record.append((sig, reads, writes, f.name))

    def _function_post(self, f):
        mode = self._mode
        if mode == _RUN:
            i = self._pos
            self._pos = i + 1
            self._post_actions(i)
        elif mode == _RECORD:
            _, reads, writes, _ = self._record[-1]
            self._touch_all(reads, writes)
            if self.record_swap_out:
                for a in reads + writes:
                    self._move(a, False)
        elif mode == _ON_DEMAND:
            self._on_demand_after(f)

    def _uses(self, f, backward):
        """(reads, writes) of a function call being recorded, as _Array lists."""
        ins, outs = f.inputs, f.outputs
        reads, writes = [], []
        if not backward:
            for v in ins:
                reads.append(self._array(v.data, f"{f.name}.in"))
            for v in outs:
                writes.append(self._array(v.data, f"{f.name}.out"))
            return reads, writes
        # backward: the outputs' gradients, the data the gradients depend on, and the inputs'
        # gradients (accumulated into unless nnabla will overwrite them)
        for v in outs:
            reads.append(self._array(v.grad, f"{f.name}.out.grad"))
        need = [i for i, v in enumerate(ins) if v.need_grad]
        for j, v in enumerate(ins):
            if any(_depends(f.grad_depends_input_data, i, j) for i in need):
                reads.append(self._array(v.data, f"{f.name}.in"))
        for j, v in enumerate(outs):
            if any(_depends(f.grad_depends_output_data, i, j) for i in need):
                reads.append(self._array(v.data, f"{f.name}.out"))
        for i in need:
            g = ins[i].grad
            a = self._array(g, f"{f.name}.in.grad")
            if _has_content(g):
                reads.append(a)          # accumulated into
            writes.append(a)
        return reads, writes

    def _on_demand_after(self, f):
        """On demand: after a function, its known arrays go back to the host."""
        for v in list(f.inputs) + list(f.outputs):
            for arr in (v.data, v.grad):
                a = self._arrays.get(hash(arr))
                if a is not None:
                    self._touched(a, True)
                    self._move(a, False)

    # --- solver hooks -------------------------------------------------------------------
    def _solver_params(self):
        out = []
        for s in self.solvers:
            states = s.get_states()
            for name, p in s.get_parameters().items():
                st = states.get(name)
                extra = [] if st is None else list(st.pstate.items())
                out.append((name, p, extra))
        return out

    def _solver_pre(self):
        mode = self._mode
        if mode == _RECORD:
            if self.solvers:
                self._solver_snapshot = [
                    (name, p, extra, p.data.modification_count, p.grad.modification_count)
                    for name, p, extra in self._solver_params()]
        elif mode == _RUN:
            i = self._pos
            sig = ("solver", self._solver_calls)
            self._solver_calls += 1
            if i >= len(self._steps):
                self._diverge("longer iteration: a solver call after the recorded functions")
                return
            if self._record[i][0] != sig:
                self._diverge(f"function {i} is solver call {sig[1]}, not the recorded "
                              f"{self._record[i][3]}")
                return
            self._pre_actions(i)

    def _solver_post(self):
        mode = self._mode
        if mode == _RECORD:
            sig = ("solver", self._solver_calls)
            self._solver_calls += 1
            reads, writes, name = [], [], "solver"
            for pname, p, extra, dmc, gmc in self._solver_snapshot or ():
                data_changed = p.data.modification_count != dmc
                grad_changed = p.grad.modification_count != gmc
                if not (data_changed or grad_changed):
                    continue
                name = f"solver[{pname}]"
                d = self._array(p.data, pname)
                g = self._array(p.grad, pname + ".grad")
                reads += [d, g]
                if data_changed:
                    writes.append(d)
                    for sname, sv in extra:
                        s = self._array(sv.data, f"{pname}.{sname}")
                        if _has_content(sv.data):
                            reads.append(s)
                        writes.append(s)
                if grad_changed:
                    writes.append(g)
                break
            self._solver_snapshot = None
            self._record.append((sig, reads, writes, name))
            self._touch_all(reads, writes)
            if self.record_swap_out:
                for a in reads + writes:
                    self._move(a, False)
        elif mode == _RUN:
            i = self._pos
            self._pos = i + 1
            self._post_actions(i)

    # --- executing a step ---------------------------------------------------------------
    def _pre_actions(self, i):
        step = self._steps[i]
        arrays = self._by_vid
        # wait_swap_out / wait_swap_in: casts from Python are synchronous; allocate: nnabla
        # allocates on write
        for v in step.swap_in:
            self._move(arrays[v], True)
        _, reads, writes, _ = self._record[i]
        self._touch_all(reads, writes)

    def _touch_all(self, reads, writes):
        for a in reads:
            self._touched(a, True)
        for a in writes:
            self._touched(a, False)

    def _post_actions(self, i):
        step = self._steps[i]
        arrays = self._by_vid
        for v in step.free:
            a = arrays[v]
            if a.persistent:
                self._move(a, False)     # dead until rewritten, but the user may read it
            # transient: the program clears it itself at this boundary
        for v in step.swap_out:
            self._move(arrays[v], False)

    # --- scheduling ---------------------------------------------------------------------
    def _build(self):
        from vmalloc.offload.sequence import FunctionSequence
        from vmalloc.offload.schedule import ScheduleError

        seq = FunctionSequence(name="nnabla")
        order: List[_Array] = []
        names = _parameter_names()
        for _, reads, writes, _ in self._record:
            for a in reads + writes:
                if a.vid is None:
                    a.persistent = not a.arr.clear_called
                    name = names.get(a.key) or f"{a.name}#{len(order)}"
                    a.vid = seq.add_variable(a.nbytes, persistent=a.persistent, name=name)
                    order.append(a)
        for a in self._arrays.values():
            if a.vid is None:
                a.vid = -1
        for _, reads, writes, name in self._record:
            seq.add_function(inputs=list(dict.fromkeys(a.vid for a in reads)),
                             outputs=list(dict.fromkeys(a.vid for a in writes)), name=name)
        had = self._sequence is not None
        self._sequence = seq
        self._by_vid = order
        self._need_record = False
        try:
            scheduler = self._make_scheduler()
            sched = scheduler.schedule(seq)
            # LMS and vDNN take no budget: their plans are checked for the rules only
            sched.check(seq, self.budget if hasattr(scheduler, "budget") else None)
        except ScheduleError as e:
            self._schedule = self._steps = None
            self.last_schedule_error = e
            self._stats["schedule_failures"] += 1
            warnings.warn(f"vmalloc.nnabla: the record cannot be scheduled within the budget "
                          f"({e}); running on demand", RuntimeWarning, stacklevel=3)
        else:
            self._schedule = sched
            self._steps = sched.steps
            self.last_schedule_error = None
        if had:
            self._stats["reschedules"] += 1

    def _make_scheduler(self):
        spec = self.scheduler
        if hasattr(spec, "schedule"):
            return spec
        from vmalloc.offload.schedulers import make_scheduler
        if spec == "window":
            return make_scheduler("window", window=self.window, budget=self.budget,
                                  persistent=self.persistent)
        return make_scheduler(spec)


def _parameter_names():
    """hash(NdArray) -> name for the registered parameters' data and gradients."""
    try:
        import nnabla as nn
        params = nn.get_parameters(grad_only=False)
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for name, p in params.items():
        out[hash(p.data)] = name
        out[hash(p.grad)] = name + ".grad"
    return out


def _depends(fn, i, j):
    try:
        return bool(fn(i, j))
    except Exception:  # noqa: BLE001 - unknown: assume it does
        return True


__all__ = ["WindowSwapScheduler", "available"]
