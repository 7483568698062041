"""Out-of-core training of an unmodified PyTorch training step.

A ``TorchDispatchMode`` sees every aten op with its tensors. Each op that moves data (the rules
of :mod:`vmalloc.offload.sequence.aten_ops`, shared with the recorder) becomes a function of the
:class:`~vmalloc.offload.Runtime`, driven through its public driver protocol only: the storages
it reads and writes are made resident before it runs, the storages it creates are adopted as
transient buffers after, and the runtime runs its schedule (swap-outs after functions, swap-ins
ahead of them) at those boundaries. An iteration ends when an optimizer's ``step()`` returns
(or at :meth:`OutOfCore.step`'s end).

**Allocation pressure.** PyTorch allocates an op's outputs itself, before the driver sees
them; so, under a budget, the driver first works out on the meta device how many bytes of
tracked outputs the op will create and asks the runtime to make room for them
(``Runtime.make_room``) before running it. On-demand iterations (recording, or a budget no
schedule fits) therefore stay within the budget too, as long as one op's own storages fit.
With nothing to move, iterations leave the dispatcher altogether
(:mod:`vmalloc.frameworks.torch_steady`); with swaps too, once they can be replayed at autograd
and module boundaries within the budget (:mod:`vmalloc.frameworks.torch_pressure`).

Swapping itself is a *backend* (:mod:`vmalloc.frameworks.torch_swap`): ``"cuda"`` (the
SwapManager over the vmalloc allocator PyTorch allocates from; only storages that own whole
chunks are tracked, asked of the allocator, so a swap never moves a pointer) or ``"poison"``
(CPU tensors, no GPU: a swapped-out storage holds 0xFF bytes until swapped in, so bit-identical
losses prove the schedule).

**Persistent storages.** Parameters and optimizer state (found through the optimizers that
step) are persistent, and so is every storage an iteration uses that an earlier iteration
created (an input reused every step, DDP's gradient buckets, gradients kept by
``zero_grad(set_to_none=False)``), and every storage a collective (``c10d``) op touches; the
record is redone once when one is found. All other storages are transient and are matched from
one iteration to the next by the order in which they first appear.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref

from vmalloc.errors import InvalidArgumentError
from vmalloc.frameworks import torch_said as said
from vmalloc.frameworks.torch_recompute import AtenRerun, rerunnable
from vmalloc.frameworks.torch_steady import ManualStep, Steady
from vmalloc.frameworks.torch_swap import CudaSwap, PoisonSwap, holds_beyond_budget
from vmalloc.frameworks.torch_predict import predicted_bytes
from vmalloc.frameworks.torch_state import Kinds, Readers, Storages, leaving, make_mode
from vmalloc.frameworks.torch_subclass import is_wrapper, plain_tensors
from vmalloc.frameworks.torch_unpredicted import Unpredicted
from vmalloc.offload.sequence import aten_ops
from vmalloc.offload.runtime import Runtime

__all__ = ["CudaSwap", "OutOfCore", "PoisonSwap", "out_of_core"]


def _torch():
    try:
        import torch
    except ImportError as error:  # pragma: no cover - torch is optional
        raise ImportError(f"vmalloc.torch.out_of_core needs PyTorch (pip install torch): "
                          f"{error}") from error
    return torch


def _runtime_takes_strict():
    import inspect
    return "strict" in inspect.signature(Runtime.__init__).parameters


class OutOfCore:
    """Out-of-core training for the training steps run inside it (see the module docs).

    Args:
        budget: device bytes the tracked storages may hold at once (int or "12GiB"). None:
            the device's capacity less a margin for ``"cuda"``; no limit for ``"poison"``
            (nothing is swapped).
        scheduler, window: as for :class:`~vmalloc.offload.Runtime`.
        backend: ``"cuda"`` (default when PyTorch has CUDA), ``"poison"`` (CPU tensors), or
            an object with the backends' methods (:mod:`vmalloc.frameworks.torch_swap`).
        min_bytes: storages smaller than this stay resident and untracked (default 64 KiB;
            with ``"cuda"`` never below what the allocator places in whole chunks).
        device: ``"cuda"`` or ``"cpu"``: which tensors are tracked (default from backend).
        allocator: the vmalloc allocator PyTorch allocates from (``"cuda"``; default the
            current one).
        persistent: ``"auto"`` (default, as every driver: parameters and optimizer state stay
            resident if that schedule fits the budget, else they swap too), ``"resident"`` or
            ``"swap"`` (as in the paper).
        strict: raise when no schedule fits the budget, instead of warning once and running
            on demand.
        compress: None (default, lossless), ``"fp16"`` or ``"bf16"``: activations seen only
            as float32 are swapped in that format, cast on the copy side; they read back cast
            to float32 (lossy, opt-in; see docs/runtime.rst). Never a parameter, gradient,
            optimizer state or a storage that outlives its iteration, and nothing in the
            first iteration (:class:`~vmalloc.frameworks.torch_state.Kinds`).
    """

    def __init__(self, budget=None, scheduler="window", window=None, backend=None,
                 min_bytes=64 << 10, device=None, allocator=None, persistent="auto",
                 strict=False, recompute=False, compress=None):
        torch = _torch()
        if device not in (None, "cuda", "cpu"):
            raise InvalidArgumentError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            # Else no tensor would ever be tracked: the block would do nothing, silently.
            raise InvalidArgumentError(
                f"device='cuda' but this PyTorch ({torch.__version__}) has no CUDA device: "
                "no tensor would be tracked; use device='cpu' with backend='poison' to train "
                "out of core on the CPU")
        if backend is None:
            backend = "cuda" if torch.cuda.is_available() else "poison"
        self.device_type = device or ("cpu" if backend == "poison" else "cuda")
        alloc, stream = None, 0
        if backend == "poison":
            self.backend = PoisonSwap()
        elif backend == "cuda":
            from vmalloc import get_current_allocator
            from vmalloc.offload import SwapManager
            cuda = torch.cuda.is_available()
            alloc = allocator or get_current_allocator(torch.cuda.current_device() if cuda
                                                       else 0)
            if alloc is None:
                raise InvalidArgumentError(
                    "backend='cuda' needs PyTorch to allocate from vmalloc: call "
                    "vmalloc.torch.use_vmalloc(...) before the first CUDA tensor")
            self.backend = CudaSwap(SwapManager(alloc), alloc)
            beyond = holds_beyond_budget(alloc, budget)
            if beyond is not None:
                if strict:
                    raise InvalidArgumentError(beyond)
                warnings.warn(beyond, UserWarning, stacklevel=3)
            stream = torch.cuda.current_stream().cuda_stream if cuda else 0
        elif isinstance(backend, str):
            raise InvalidArgumentError(
                f"backend must be 'cuda', 'poison' or a swap backend object, got {backend!r}")
        else:
            self.backend = backend
        self.min_bytes = max(int(min_bytes), getattr(self.backend, "min_bytes", 0))
        if budget is None and alloc is None and scheduler == "window" and window is None:
            scheduler = "none"    # no budget and no device: nothing needs to leave
        options = dict(budget=budget, scheduler=scheduler, window=window, swap=self.backend,
                       host_compute=False, stream=stream, persistent=persistent)
        if recompute:
            options["recompute"] = True    # (the driver's reruns: torch_recompute)
        self._runtime_says = _runtime_takes_strict()
        if self._runtime_says:
            options["strict"] = strict
        self.strict = bool(strict)
        if compress is not None:
            options["compress"] = compress
        self.compress = compress
        self.runtime = Runtime(alloc, **options)
        self._storages = Storages(self)
        self._readers = Readers(self)
        self._unpredicted = Unpredicted(self)
        self._kinds = Kinds(self) if compress is not None else None
        self._mode = None
        self._hook = None
        self._pre_hook = None
        self._optimizers = weakref.WeakSet()
        self._manual = False
        self._iteration = 0            # iterations begun
        self._promote = []             # buffers found long-lived, made persistent next begin
        self._collective = set()       # ids of buffers a collective op touched
        self._said = set()             # warnings given (each once)
        self._counts = dict(over_budget_ops=0, promoted_storages=0, dispatched_ops=0,
                            meta_predictions=0)
        self._resized = 0              # storages resized outside the dispatcher (FSDP2)
        self._predictions = {}         # op and argument key -> predicted bytes (torch_predict)
        self._steady = Steady(self)    # no per-op Python once nothing moves (torch_steady)
        self._peak = None

    # --- user API -------------------------------------------------------------------------
    def __enter__(self):
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        active = getattr(_active, "block", None)
        if active is not None:
            # Two dispatch modes would both drive their own runtime over the same storages
            # (each swapping out what the other's op reads): refused, the outer one untouched.
            raise InvalidArgumentError(
                "vmalloc.torch.out_of_core blocks do not nest: one is active in this thread "
                f"already (budget {active.runtime.budget}); leave it before entering another")
        self._peak = None
        self._mode = make_mode(self)
        self._mode.__enter__()
        self._hook = register_optimizer_step_post_hook(self._after_optimizer_step)
        if self._kinds is not None:
            self._pre_hook = register_optimizer_step_pre_hook(
                lambda opt, args, kwargs: self._kinds.before_step(opt))
        self._readers.install()
        _active.block = self
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            leaving(exc_type, lambda: self.runtime.in_iteration
                    and self._end_iteration(failed=exc_type is not None), exc=exc)
        finally:
            _active.block = None
            self._steady.close()       # (its mode already popped when steady)
            self._readers.remove()
            self._hook.remove()
            if self._pre_hook is not None:
                self._pre_hook.remove()
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
            # The peak is the training's: bringing everything back on leaving is not counted.
            self._peak = self.runtime.stats()["peak_device_bytes"]
            leaving(exc_type, self._storages.collect, self.runtime.restore_all, exc=exc)
        return False

    def step(self):
        """A context manager marking one iteration explicitly (for loops without an
        optimizer ``step()``)."""
        return ManualStep(self)

    def stats(self) -> dict:
        """The runtime's statistics, plus ``over_budget_ops`` (ops whose own storages did
        not fit the budget), ``promoted_storages`` (storages found long-lived), and the
        steady state's counts (:mod:`~vmalloc.frameworks.torch_steady`; under pressure
        ``pressure_*``: :mod:`~vmalloc.frameworks.torch_pressure`). After the block
        every value stays as it was (``peak_device_bytes``: the peak inside the block;
        bringing everything back on leaving is not counted)."""
        out = self.runtime.stats()
        out.update(self._counts)
        out.update(self._steady.counts)
        pressure = self._steady.pressure
        out.update(pressure.counts)
        out["pressure_refused"] = pressure.refused
        out["pressure_deferred"] = pressure.deferred    # (swap-outs waited for late)
        out["iterations"] += self._steady.counts["steady_iterations"]
        out["scheduled_iterations"] += self._steady.counts["steady_iterations"]
        out["diverged_iterations"] += self._steady.late
        if self._peak is not None:
            out["peak_device_bytes"] = self._peak
        if pressure.counts["pressure_iterations"]:    # (its bound: the runtime sees no op)
            out["peak_device_bytes"] = max(out["peak_device_bytes"],
                                           pressure.counts["pressure_peak_bound"])
        return out

    # --- iterations -----------------------------------------------------------------------
    def _tracked(self, t):
        torch = sys.modules["torch"]
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type \
                or t.layout != torch.strided or is_wrapper(t):
            return False     # (a wrapper subclass: its inner tensors are tracked)
        s = t.untyped_storage()
        n = s.nbytes()
        return n >= self.min_bytes and self.backend.tracks(s.data_ptr(), n) \
            if hasattr(self.backend, "tracks") else n >= self.min_bytes

    def _persistent_tensors(self):
        """Parameters and optimizer state of the optimizers seen so far (the inner tensors of
        wrapper subclasses)."""
        out = []
        for opt in list(self._optimizers):
            for group in opt.param_groups:
                out.extend(group["params"])
            for state in opt.state.values():
                out.extend(v for v in state.values() if hasattr(v, "untyped_storage"))
        return plain_tensors(out)

    def _begin_iteration(self):
        rt = self.runtime
        self._storages.collect()
        if self._kinds is not None:
            self._kinds.begin()
        promote = [b for b in self._promote if b.alive]
        self._promote = []
        for t in self._persistent_tensors():
            if self._tracked(t):
                buf = self._storages.known(t.untyped_storage())
                if buf is None:
                    self._make_room(t.untyped_storage().nbytes())
                    self._storages.buffer(t.untyped_storage(), persistent=True)
                elif not buf.persistent:
                    promote.append(buf)   # adopted as transient before its optimizer stepped
        for buf in dict.fromkeys(promote):
            self._storages.make_persistent(buf)
        if promote:
            self._counts["promoted_storages"] += len(promote)
            rt.invalidate(f"{len(promote)} storage(s) outlive their iteration: persistent now")
        self._iteration += 1
        self._steady.begin_probation()
        rt.begin_iteration()

    def _end_iteration(self, failed=False):
        self._storages.collect()
        before = self.runtime.stats().get("schedule_failures", 0)
        self.runtime.end_iteration(failed=failed)
        self._steady.ended(failed)
        if not self._runtime_says and self.runtime.stats().get("schedule_failures", 0) > before:
            self._unschedulable()

    def _after_optimizer_step(self, optimizer, args, kwargs):
        self._steady.pressure.stepped()
        if self._kinds is not None:
            self._kinds.after_step()
        new = optimizer not in self._optimizers
        self._optimizers.add(optimizer)
        if self._steady.active:
            if new:
                self._steady.leave("a new optimizer stepped: its state is persistent")
            elif not self._manual:
                self._steady.boundary()
            return
        if self.runtime.in_iteration and not self._manual:
            self._end_iteration()
        if new:
            # First sight of this optimizer: its parameters and state were recorded as
            # transient, so the record is wrong: record again next iteration.
            if self._steady.active:     # (a second optimizer after the probation's end)
                self._steady.leave("a new optimizer stepped: its state is persistent")
            else:
                self.runtime.invalidate("a new optimizer stepped: its state is persistent")

    def _ensure_iteration(self):
        if not self.runtime.in_iteration and not self._manual:
            self._begin_iteration()

    def _fail_iteration(self):
        """An op raised (out of memory...): the iteration ends here, failed, so that the
        program may catch the error and go on (say, with a smaller batch)."""
        if self.runtime.in_iteration and not self._manual:
            self.runtime.end_iteration(failed=True)

    def _make_room(self, nbytes):
        if nbytes and self.runtime.budget is not None and not self.runtime.make_room(nbytes):
            return False
        return True

    _unschedulable, _say, _over_budget = said.unschedulable, said.say, said.over_budget

    # --- ops ------------------------------------------------------------------------------
    def _dispatch(self, func, args, kwargs):
        self._counts["dispatched_ops"] += 1
        if not aten_ops.is_function(func):
            return func(*args, **kwargs)
        rt = self.runtime
        storages = self._storages
        storages.collect()
        if self._readers.check_compiled and self._iteration <= 3:
            self._readers.compiled_region()
        accessed = [(t, r, w) for t, r, w in aten_ops.accesses(func, args, kwargs)
                    if self._tracked(t)]
        fresh = predicted_bytes(self, func, args, kwargs)   # None: unknown
        predicted = fresh
        if rt.budget is not None and self._unpredicted.sizes:
            learned = self._unpredicted.measured(func, args, kwargs)   # None: never short
            if learned is not None:
                fresh = max(fresh or 0, learned)
        if not accessed and not fresh:
            out = func(*args, **kwargs)
            outs = self._fresh_tensors(func, out)
            if not outs:
                return out
            self._ensure_iteration()
            return self._run(func, (), (), lambda: out, 0, outs=outs,
                             measure=(args, kwargs, predicted, fresh))
        self._ensure_iteration()
        unknown = sum({s.data_ptr(): s.nbytes() for s in
                       (t.untyped_storage() for t, _, _ in accessed)
                       if storages.known(s) is None}.values())
        if not self._make_room(unknown):    # storages that exist already but were never seen
            try:
                self._over_budget(str(func), unknown, unseen=True)
            except BaseException:
                self._fail_iteration()     # (strict) as an op that raised
                raise
        reads, writes = [], []
        for t, read, written in accessed:
            buf = storages.buffer(t.untyped_storage(), dtype=t.dtype)
            if storages.iteration_of(buf) < self._iteration and not buf.persistent:
                self._promote.append(buf)
                if self._kinds is not None:
                    self._kinds.revoke(buf, "unknown")    # outlives its iteration
            if read and buf not in reads:
                reads.append(buf)
            if written and buf not in writes:
                writes.append(buf)
        return self._run(func, reads, writes, lambda: func(*args, **kwargs), fresh or 0,
                         rerun_args=(args, kwargs), measure=(args, kwargs, predicted, fresh))

    def _run(self, func, reads, writes, call, fresh, outs=None, rerun_args=None,
             measure=None):
        """One op as one function of the runtime (``measure``: its arguments, the bytes of
        outputs predicted on the meta device (None: unknown) and made room for: what it
        created is measured after it ran, :class:`Unpredicted`)."""
        rt = self.runtime
        name = str(func)
        entered = False
        try:
            rt.enter_function(reads, writes, name=name)
            entered = True
            if fresh and not self._make_room(fresh):
                self._over_budget(name, fresh)
            out = call()
            if func.namespace == "c10d":
                self._collective_done(out, reads, writes)
            if outs is None:
                outs = self._fresh_tensors(func, out)
            new = self._new_buffers(outs, set(map(id, reads)) | set(map(id, writes)))
            if new:
                rt.add_writes(new)
                if rerun_args is not None and rt.recompute and not writes and len(new) == 1 \
                        and len(outs) == 1 and len(func._schema.returns) == 1 \
                        and rerunnable(func, self.device_type):
                    rerun = AtenRerun.make(func, *rerun_args, outs[0], self._tracked)
                    if rerun is not None:
                        rt.set_rerun(rerun)
            if self._steady.pressure.probing:
                self._steady.pressure.sample(list(reads) + list(writes) + new)
            if measure is not None and rt.budget is not None:
                self._unpredicted.ran(func, *measure, sum(b.nbytes for b in new), name)
        except BaseException:
            if entered and rt.in_function:
                rt.exit_function(failed=True)
            self._fail_iteration()
            raise
        rt.exit_function()
        self._storages.collect()
        return out

    def _collective_done(self, out, reads, writes):
        """A collective's Work runs on the backend's own thread: its tensors must stay where
        they are until it completes, so the function waits for it (on CPU with gloo;
        with NCCL see the docs), and its storages (DDP's buckets) are persistent."""
        for item in (out if isinstance(out, (tuple, list)) else (out,)):
            wait = getattr(item, "wait", None)
            if callable(wait) and not hasattr(item, "untyped_storage"):
                wait()
        for buf in list(reads) + list(writes):
            if not buf.persistent:
                self._promote.append(buf)

    def _fresh_tensors(self, func, out):
        if aten_ops.fresh_returns(func) == 0:
            return []
        Tensor = sys.modules["torch"].Tensor
        if isinstance(out, Tensor):
            flat = (out,)      # (most ops: pytree's flattening cost more than the rest)
        elif type(out) is tuple and all(isinstance(t, Tensor) for t in out):
            flat = out
        else:
            from torch.utils._pytree import tree_leaves
            flat = tree_leaves(out)
        return [t for t in flat if self._tracked(t)]

    def _new_buffers(self, tensors, known):
        new = []
        for t in tensors:
            s = t.untyped_storage()
            if self._storages.known(s) is not None:
                self._storages.buffer(s, dtype=t.dtype)   # (notes the dtype it is seen as)
                continue     # an alias of a storage the driver tracks already
            buf = self._storages.buffer(s, dtype=t.dtype)
            if id(buf) not in known:
                known.add(id(buf))
                new.append(buf)
                if self._kinds is not None:
                    self._kinds.created(buf)
        return new


_active = threading.local()     # .block: the OutOfCore active in this thread


def out_of_core(budget=None, scheduler="window", window=None, backend=None,
                min_bytes=64 << 10, device=None, allocator=None,
                persistent="auto", strict=False, recompute=False, compress=None) -> OutOfCore:
    """Turns on out-of-core training for the steps run inside ``with``::

        with vmalloc.torch.out_of_core(budget="12GiB") as ooc:
            for x, y in loader:
                loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        print(ooc.stats())
    """
    return OutOfCore(budget=budget, scheduler=scheduler, window=window, backend=backend,
                     min_bytes=min_bytes, device=device, allocator=allocator,
                     persistent=persistent, strict=strict, recompute=recompute,
                     compress=compress)
