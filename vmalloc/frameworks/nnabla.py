"""Out-of-core training with nnabla: a thin driver over :class:`vmalloc.offload.Runtime`.

nnabla cannot take an external allocator from Python, so the driver tells the runtime what
nnabla does, through nnabla's global function and solver hooks, and the runtime's swaps are
nnabla's own array casts (:class:`NnablaSwap`, a swap backend as PyTorch's poison and CUDA
backends are): swap-out = ``cast(dtype, host_ctx)``, swap-in = ``cast(dtype, device_ctx)``.

- Each function call (forward or backward) is a runtime function with the arrays
  (``NdArray``) it reads and writes: a function's first call in an iteration is its forward
  (reads the inputs' data, writes the outputs' data), the next its backward (reads the outputs'
  gradients and the data its gradient depends on, writes the inputs' gradients, and reads them
  when nnabla accumulates into them). Solver calls are functions too; nnabla's solver hooks do
  not say which arrays they touch, so nnabla brings those to the device itself.
- Arrays are adopted by the runtime when first seen (``hash(NdArray)`` is the key; the driver
  holds a reference so an address is never reused while it is known). An array the program
  clears (``clear_buffer``, ``clear_no_need_grad``) is forgotten at the next boundary: it is
  transient, adopted again when it is next written. An array that outlives an iteration
  (parameters, gradients, solver state, inputs, the loss) is marked persistent at the end of
  the recorded iteration.
- Everything else is the runtime's: record, schedule, follow, diverge (a changed iteration
  never crashes or corrupts: nnabla's own ``SwapInOutScheduler`` indexes its record without a
  bounds check and segfaults on an iteration longer than the recorded one), the budget, the
  warnings and ``stats()``.

Use it as nnabla's scheduler (one ``with`` per iteration)::

    from vmalloc.nnabla import WindowSwapScheduler
    sched = WindowSwapScheduler(host_ctx, device_ctx, budget="64MiB", solver=solver)
    for batch in data:
        with sched:
            x.d = batch
            loss.forward(clear_no_need_grad=True)
            solver.zero_grad()
            loss.backward(clear_buffer=True)
            solver.update()
    print(sched.stats())

or with the shape every framework driver has::

    with vmalloc.nnabla.out_of_core(budget="64MiB") as ooc:
        for batch in data:
            with ooc.step():
                ...
    print(ooc.stats())

This module imports without nnabla; using the driver without nnabla raises ImportError saying
what to install (nnabla's wheels exist for Python 3.8-3.10).
"""

from __future__ import annotations

import time
import weakref
from typing import Dict, List

from vmalloc.frameworks.nnabla_swap import NnablaSwap, _nbytes

_INSTALL_HINT = (
    "vmalloc.nnabla needs nnabla: pip install 'nnabla' 'numpy~=1.26.0' 'protobuf~=3.20' "
    "(nnabla's wheels exist only for Python 3.8-3.10)")

_HOOK_KEY = "vmalloc_nnabla_{}_{}"


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


def use_vmalloc(*args, **kwargs):
    """nnabla takes no external allocator from Python: out-of-core training goes through its
    own array casts (:func:`out_of_core`)."""
    raise NotImplementedError("nnabla cannot take an external allocator from Python; use "
                              "vmalloc.nnabla.out_of_core(...) (nnabla's own casts swap)")


class OutOfCore:
    """Out-of-core training of nnabla programs over a :class:`~vmalloc.offload.Runtime`
    (module docs). Use ``with ooc:`` around the training loop and ``with ooc.step():`` around
    each iteration.

    Args:
        host_ctx: nnabla context of host memory (default ``Context(['cpu:float'],
            'CpuArray', '0')``).
        device_ctx: nnabla context of device memory (default: nnabla's current context; on a
            CPU-only machine ``Context(['cpu:float'], 'CpuCachedArray', '0')``).
        budget, scheduler, window, persistent, strict: as for
            :class:`~vmalloc.offload.Runtime` (``budget=None``: no limit, as the backend has
            no device to measure; ``persistent="auto"``).
        solver: the nnabla solver (or a list), accepted as before; nnabla's solver hooks do
            not say which arrays a call touches, so solver calls list none (``self.solvers``).
    """

    def __init__(self, host_ctx=None, device_ctx=None, budget=None, scheduler="window",
                 window=None, persistent="auto", solver=None, strict=False):
        nn = _import_nnabla()
        from vmalloc.offload.runtime import Runtime

        if host_ctx is None:
            host_ctx = nn.Context(["cpu:float"], "CpuArray", "0")
        if device_ctx is None:
            device_ctx = nn.get_current_context()
        self.host_ctx, self.device_ctx = host_ctx, device_ctx
        self.backend = NnablaSwap(host_ctx, device_ctx)
        self.runtime = Runtime(None, budget=budget, scheduler=scheduler, window=window,
                               swap=self.backend, host_compute=False, persistent=persistent,
                               strict=strict)
        # Weak: the runtime (held by this driver) must not hold the driver back (a reference
        # cycle would keep both, and the arrays they track, until a full collection).
        collect = weakref.WeakMethod(self._collect)

        def at_boundary():
            method = collect()
            if method is not None:
                method()
        self.runtime.at_boundary = at_boundary
        self.budget = self.runtime.budget
        self.window = self.runtime.window
        self.scheduler = scheduler
        self.persistent = persistent
        if solver is None:
            self.solvers = []
        else:
            self.solvers = list(solver) if isinstance(solver, (list, tuple)) else [solver]
        self._key = _HOOK_KEY.format(id(self), "{}")
        self._bufs: Dict[int, tuple] = {}      # hash(NdArray) -> (buffer, NdArray)
        self._transient: Dict[int, object] = {}  # keys of this iteration's transient arrays
        self._fresh = set()                    # adopted for the running function
        self._fcount: Dict[tuple, int] = {}
        self._hooked = False
        self._before = None
        self._t0 = 0.0
        #: Per iteration: mode ("record", "run" or "on_demand"), the bytes cast each way,
        #: seconds, and why it left the schedule (``mismatch``, None if it did not).
        self.history: List[dict] = []

    # --- the region and its iterations ----------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.runtime.in_iteration:
            self._end(failed=exc_type is not None)
        self._collect()
        self.runtime.restore_all()
        return False

    def step(self):
        """A context manager around one iteration."""
        driver = self

        class _Step:
            def __enter__(self):
                driver.start()
                return driver

            def __exit__(self, exc_type, exc, tb):
                driver._end(failed=exc_type is not None)
                return False
        return _Step()

    def start(self):
        """Starts an iteration and registers nnabla's hooks."""
        import nnabla.callback as cb
        if self._hooked:
            raise RuntimeError("start() called twice without end()")
        self._collect()
        self._fcount = {}
        self._before = self.runtime.stats()
        self._t0 = time.perf_counter()
        self.runtime.begin_iteration()
        cb.set_function_pre_hook(self._key.format("fpre"), self._function_pre)
        cb.set_function_post_hook(self._key.format("fpost"), self._function_post)
        cb.set_solver_pre_hook(self._key.format("spre"), self._solver_pre)
        cb.set_solver_post_hook(self._key.format("spost"), self._solver_post)
        self._hooked = True

    def end(self):
        """Ends the iteration (unregisters the hooks)."""
        self._end(failed=False)

    def _end(self, failed):
        import nnabla.callback as cb
        if not self._hooked:
            raise RuntimeError("end() without start()")
        self._hooked = False
        cb.unset_function_pre_hook(self._key.format("fpre"))
        cb.unset_function_post_hook(self._key.format("fpost"))
        cb.unset_solver_pre_hook(self._key.format("spre"))
        cb.unset_solver_post_hook(self._key.format("spost"))
        rt = self.runtime
        if rt.in_function:
            rt.exit_function(failed=True)
        self._fresh.clear()
        self._collect()
        # Arrays of this iteration the program did not clear outlive it: persistent.
        for key in list(self._transient):
            self._bufs[key][0].persistent = True
        self._transient.clear()
        rt.end_iteration(failed=failed)
        self._note_history()

    def _note_history(self):
        before, after = self._before, self.runtime.stats()
        if after["recorded_iterations"] > before["recorded_iterations"]:
            mode = "record"
        elif after["diverged_iterations"] > before["diverged_iterations"]:
            mode = "on_demand"
        elif after["scheduled_iterations"] > before["scheduled_iterations"]:
            mode = "run"
        else:
            mode = "on_demand"
        mismatch = (self.runtime.last_divergence
                    if after["diverged_iterations"] > before["diverged_iterations"] else None)
        self.history.append(dict(
            mode=mode, mismatch=mismatch, seconds=time.perf_counter() - self._t0,
            swap_in_bytes=after["swapped_in_bytes"] - before["swapped_in_bytes"],
            swap_out_bytes=after["swapped_out_bytes"] - before["swapped_out_bytes"],
            on_demand_swap_ins=after["on_demand_swap_ins"] - before["on_demand_swap_ins"]))

    # --- results ---------------------------------------------------------------------------
    @property
    def sequence(self):
        """The recorded :class:`~vmalloc.offload.FunctionSequence` (None before a record)."""
        return self.runtime.sequence

    @property
    def schedule(self):
        """The :class:`~vmalloc.offload.Schedule` being followed (None if none)."""
        return self.runtime.schedule

    def stats(self) -> dict:
        """The runtime's stats (:data:`vmalloc.offload.runtime.STATS_KEYS`), with the
        schedule's planned peak and the record's in-core peak when there are ones."""
        out = self.runtime.stats()
        if self.schedule is not None:
            out["planned_peak_bytes"] = self.schedule.planned_peak
        if self.sequence is not None:
            out["in_core_peak_bytes"] = self.sequence.in_core_peak()
        return out

    # --- arrays ----------------------------------------------------------------------------
    def _buffer(self, arr):
        key = hash(arr)
        entry = self._bufs.get(key)
        if entry is not None and entry[0].alive:
            return entry[0]
        buf = self.runtime.adopt(key, _nbytes(arr), persistent=False)
        self.backend.register(key, arr)
        self._bufs[key] = (buf, arr)     # the reference keeps the address from being reused
        self._transient[key] = arr
        self._fresh.add(key)             # cleared until the running function writes it
        return buf

    def _collect(self):
        """Forgets the arrays the program cleared (at every function boundary)."""
        for key, arr in list(self._transient.items()):
            if arr.clear_called and key not in self._fresh:
                del self._transient[key]
                buf = self._bufs.pop(key)[0]
                self.runtime.forget(buf, freed=True)

    # --- hooks -----------------------------------------------------------------------------
    def _function_pre(self, f):
        self._collect()       # first: an array cleared and now rewritten is adopted anew
        base = (f.name, tuple(hash(v.data) for v in f.inputs),
                tuple(hash(v.data) for v in f.outputs))
        n = self._fcount.get(base, 0)
        self._fcount[base] = n + 1
        reads, writes = self._uses(f, backward=n > 0)
        name = f.name if n == 0 else f"{f.name}.backward" if n == 1 else f"{f.name}#{n}"
        self.runtime.enter_function(list(dict.fromkeys(reads)), list(dict.fromkeys(writes)),
                                    name=name)

    def _function_post(self, f):
        self._fresh.clear()
        self.runtime.exit_function()

    def _solver_pre(self):
        self.runtime.enter_function((), (), name="solver")

    def _solver_post(self):
        self.runtime.exit_function()

    def _uses(self, f, backward):
        """(reads, writes) of a function call, as runtime buffers."""
        ins, outs = f.inputs, f.outputs
        if not backward:
            return ([self._buffer(v.data) for v in ins], [self._buffer(v.data) for v in outs])
        # backward: the outputs' gradients, the data the gradients depend on, and the inputs'
        # gradients (accumulated into unless nnabla will overwrite them)
        reads, writes = [], []
        for v in outs:
            reads.append(self._buffer(v.grad))
        need = [i for i, v in enumerate(ins) if v.need_grad]
        for j, v in enumerate(ins):
            if any(_depends(f.grad_depends_input_data, i, j) for i in need):
                reads.append(self._buffer(v.data))
        for j, v in enumerate(outs):
            if any(_depends(f.grad_depends_output_data, i, j) for i in need):
                reads.append(self._buffer(v.data))
        for i in need:
            buf = self._buffer(ins[i].grad)
            # Read and written: nnabla accumulates into it unless it will overwrite it, which
            # depends on its state; listing it always keeps the record stable across iterations.
            reads.append(buf)
            writes.append(buf)
        return reads, writes


class WindowSwapScheduler(OutOfCore):
    """nnabla's scheduler API (``nnabla.lms.SwapInOutScheduler``) over the runtime: one
    ``with scheduler:`` (or ``start()`` / ``end()``, also spelled ``start_scheduling()`` /
    ``end_scheduling()``) per iteration.

    Args:
        host_ctx, device_ctx: nnabla contexts of host and device memory.
        budget: device bytes the schedule may hold at once (int or "64MiB"; None: no limit).
        window, scheduler, solver, persistent, strict: as for :class:`OutOfCore`.
    """

    def __init__(self, host_ctx, device_ctx, budget=None, window=None, scheduler="window",
                 solver=None, persistent="auto", strict=False):
        super().__init__(host_ctx, device_ctx, budget=budget, scheduler=scheduler,
                         window=window, persistent=persistent, solver=solver, strict=strict)

    start_scheduling = OutOfCore.start
    end_scheduling = OutOfCore.end

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._end(failed=exc_type is not None)
        return False


def out_of_core(budget=None, scheduler="window", window=None, persistent="auto",
                host_ctx=None, device_ctx=None, solver=None, strict=False) -> OutOfCore:
    """Out-of-core training of the nnabla iterations run inside ``with ooc.step():`` (see
    :class:`OutOfCore`)."""
    return OutOfCore(host_ctx=host_ctx, device_ctx=device_ctx, budget=budget,
                     scheduler=scheduler, window=window, persistent=persistent,
                     solver=solver, strict=strict)


def _depends(fn, i, j):
    try:
        return bool(fn(i, j))
    except Exception:  # noqa: BLE001 - unknown: assume it does
        return True


__all__ = ["WindowSwapScheduler", "OutOfCore", "NnablaSwap", "out_of_core", "use_vmalloc",
           "available"]
