"""Out-of-core training of an unmodified PyTorch training step.

A ``TorchDispatchMode`` sees every aten op with its tensors. Each op becomes a function of the
:class:`~vmalloc.offload.Runtime`: the storages it reads (and mutates) are made resident before
it runs, the storages it creates are adopted as transient buffers after, and the runtime runs
its schedule (swap-outs after functions, swap-ins ahead of them) at those boundaries. An
iteration ends when an optimizer's ``step()`` returns (or at :meth:`OutOfCore.step`'s end).

Swapping itself is a *backend*:

- ``"cuda"``: the :class:`~vmalloc.offload.SwapManager` over the vmalloc allocator PyTorch
  allocates from (:func:`vmalloc.torch.use_vmalloc`); on the virtual allocator a storage's
  pointer never changes, so PyTorch never notices. Storages sharing chunks (small-block arena)
  stay resident below ``min_bytes``.
- ``"poison"``: for CPU tensors, no GPU needed. A swap-out copies a storage's bytes aside and
  overwrites the storage with 0xFF bytes (NaN for floats); a swap-in restores them. A schedule
  that lets an op read a swapped-out storage changes the results, so training losses that are
  bit-identical to an ordinary run prove the schedule, on CPU, in CI.

Storages the program keeps across iterations (parameters, optimizer state: found through the
optimizers that step) are persistent; all others are transient and are matched from one
iteration to the next by the order in which they first appear.
"""

from __future__ import annotations

import weakref
from typing import List

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.runtime import Runtime

# Ops that move no data (besides views, which func.is_view tells): not functions.
_SKIP = frozenset({"empty", "empty_strided", "detach", "alias", "lift_fresh", "sym_size",
                   "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
                   "_reshape_alias", "set_", "resize_"})


def _torch():
    try:
        import torch
    except ImportError as error:  # pragma: no cover - torch is optional
        raise ImportError(f"vmalloc.torch.out_of_core needs PyTorch (pip install torch): "
                          f"{error}") from error
    return torch


class PoisonSwap:
    """The ``"poison"`` backend: swaps CPU storages by copying them aside and poisoning them.

    Keys are storage addresses (a CPU storage keeps its address while swapped). Copies are
    synchronous, so every swap is complete when issued; states still follow the SwapManager's
    (``swapping_out`` until waited), so the runtime's protocol is exercised in full.
    """

    def __init__(self):
        self._storages = {}   # ptr -> storage
        self._host = {}       # ptr -> saved bytes (a uint8 tensor)
        self._state = {}      # ptr -> state, absent = resident
        self._stats = dict(bytes_swapped_out=0, bytes_swapped_in=0, swap_outs=0, swap_ins=0)

    def register(self, ptr, storage):
        # Weak: the backend must not keep a storage PyTorch has freed alive.
        self._storages[ptr] = weakref.ref(storage)

    def unregister(self, ptr, storage=None):
        ref = self._storages.get(ptr)
        if ref is not None and (storage is None or ref() is None or ref() is storage):
            del self._storages[ptr]

    def _bytes(self, ptr):
        """A byte view of the storage at ptr, or None if PyTorch has freed it."""
        torch = _torch()
        ref = self._storages.get(ptr)
        storage = ref() if ref is not None else None
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def state(self, key):
        return self._state.get(key, "resident")

    def swap_out(self, ptr, stream=0):
        from torch.utils._python_dispatch import _disable_current_modes
        if self.state(ptr) != "resident":
            raise InvalidArgumentError(f"swap_out: {ptr:#x} is {self.state(ptr)}")
        with _disable_current_modes():
            view = self._bytes(ptr)
            if view is None:
                raise InvalidArgumentError(f"swap_out: the storage at {ptr:#x} was freed")
            self._host[ptr] = view.clone()
            view.fill_(255)
        self._state[ptr] = "swapping_out"
        self._stats["bytes_swapped_out"] += view.numel()
        self._stats["swap_outs"] += 1
        return ptr

    def wait(self, key, stream=0):
        state = self.state(key)
        if state == "swapping_out":
            self._state[key] = "on_host"
        elif state == "swapping_in":
            del self._state[key]
        else:
            raise InvalidArgumentError(f"wait: {key:#x} has no copy in flight ({state})")

    def swap_in(self, key, stream=0):
        from torch.utils._python_dispatch import _disable_current_modes
        state = self.state(key)
        if state not in ("on_host", "swapping_out"):
            raise InvalidArgumentError(f"swap_in: {key:#x} is {state}")
        with _disable_current_modes():
            view = self._bytes(key)
            if view is None:
                raise InvalidArgumentError(f"swap_in: the storage at {key:#x} was freed")
            view.copy_(self._host.pop(key))
        if state == "swapping_out":
            del self._state[key]      # cancelled: nothing left in flight
        else:
            self._state[key] = "swapping_in"
            self._stats["bytes_swapped_in"] += view.numel()
            self._stats["swap_ins"] += 1
        return key

    def discard(self, key):
        self._host.pop(key, None)
        self._state.pop(key, None)

    def stats(self):
        out = dict(self._stats)
        out["host_bytes"] = sum(t.numel() for t in self._host.values())
        return out


class CudaSwap:
    """The ``"cuda"`` backend: the :class:`~vmalloc.offload.SwapManager` over the vmalloc
    allocator PyTorch allocates from, keyed by storage pointers (stable on the virtual
    allocator). While a storage is not resident the backend holds it, so PyTorch cannot free
    memory whose bytes are on the host; the hold ends when its swap-in is waited."""

    def __init__(self, manager):
        self.manager = manager
        self._weak = {}     # ptr -> storage weakref
        self._held = {}     # ptr -> storage, while not resident

    def register(self, ptr, storage):
        self._weak[ptr] = weakref.ref(storage)

    def unregister(self, ptr, storage=None):
        if ptr not in self._held:
            self._weak.pop(ptr, None)

    def state(self, key):
        return self.manager.state(key)

    def swap_out(self, ptr, stream=0):
        ref = self._weak.get(ptr)
        storage = ref() if ref is not None else None
        self.manager.swap_out(ptr, stream=stream)
        if storage is not None:
            self._held[ptr] = storage
        return ptr

    def wait(self, key, stream=0):
        swapping_in = self.manager.state(key) == "swapping_in"
        self.manager.wait(key, stream=stream)
        if swapping_in:
            self._held.pop(key, None)

    def swap_in(self, key, stream=0):
        ptr = self.manager.swap_in(key, stream=stream)
        if ptr != key:
            raise InvalidArgumentError(
                f"the storage at {key:#x} was relocated to {ptr:#x}: PyTorch's pointers must "
                "not move; use the virtual allocator (chunk placement) and min_bytes above "
                "its small_threshold")
        if self.manager.state(ptr) == "resident":
            self._held.pop(ptr, None)
        return ptr

    def discard(self, key):
        # A held storage cannot have been freed; nothing else reaches here.
        self._held.pop(key, None)

    def stats(self):
        return self.manager.stats()


class _Storages:
    """Storage -> runtime buffer, with finalizers that report freed storages."""

    def __init__(self, driver):
        self.driver = driver
        self.by_key = {}        # id(storage) -> (buffer, storage weakref)
        self.dead: List[int] = []

    def buffer(self, storage, persistent=None):
        key = id(storage)
        entry = self.by_key.get(key)
        if entry is not None and entry[1]() is storage:
            return entry[0]
        rt = self.driver.runtime
        ptr = storage.data_ptr()
        buf = rt.adopt(ptr, storage.nbytes(), persistent=persistent)
        backend = self.driver.backend
        if hasattr(backend, "register"):
            backend.register(ptr, storage)
        self.by_key[key] = (buf, weakref.ref(storage))
        weakref.finalize(storage, self.dead.append, key)
        return buf

    def collect(self):
        """Forgets the buffers of storages PyTorch freed (deferred: finalizers run anywhere)."""
        while self.dead:
            key = self.dead.pop()
            entry = self.by_key.pop(key, None)
            if entry is None:
                continue
            buf = entry[0]
            self.driver.runtime.forget(buf)
            backend = self.driver.backend
            if hasattr(backend, "unregister"):
                backend.unregister(buf.ptr)   # only if no live storage took the address


class OutOfCore:
    """Out-of-core training for the training steps run inside it (see the module docs).

    Args:
        budget: device bytes the tracked storages may hold at once (int or "12GiB").
        scheduler, window: as for :class:`~vmalloc.offload.Runtime`.
        backend: ``"cuda"`` (default when PyTorch allocates CUDA memory from vmalloc),
            ``"poison"`` (CPU tensors), or an object with the SwapManager's methods.
        min_bytes: storages smaller than this stay resident and untracked (default 64 KiB).
        device: ``"cuda"`` or ``"cpu"``: which tensors are tracked (default from backend).
        persistent: ``"resident"`` (default: parameters and optimizer state stay on the
            device) or ``"swap"`` (they swap too, as in the paper).
    """

    def __init__(self, budget=None, scheduler="window", window=None, backend=None,
                 min_bytes=64 << 10, device=None, allocator=None, persistent="resident"):
        torch = _torch()
        if backend is None:
            backend = "cuda" if torch.cuda.is_available() else "poison"
        self.device_type = device or ("cpu" if backend == "poison" else "cuda")
        if backend == "poison":
            self.backend = PoisonSwap()
            self.runtime = Runtime(None, budget=budget, scheduler=scheduler, window=window,
                                   swap=self.backend, host_compute=False,
                                   persistent=persistent)
        elif backend == "cuda":
            from vmalloc import get_current_allocator
            from vmalloc.offload import SwapManager
            alloc = allocator or get_current_allocator(torch.cuda.current_device())
            if alloc is None:
                raise InvalidArgumentError(
                    "backend='cuda' needs PyTorch to allocate from vmalloc: call "
                    "vmalloc.torch.use_vmalloc(...) before the first CUDA tensor")
            self.backend = CudaSwap(SwapManager(alloc))
            self.runtime = Runtime(alloc, budget=budget, scheduler=scheduler, window=window,
                                   swap=self.backend, host_compute=False,
                                   stream=torch.cuda.current_stream().cuda_stream,
                                   persistent=persistent)
        else:
            self.backend = backend
            self.runtime = Runtime(None, budget=budget, scheduler=scheduler, window=window,
                                   swap=backend, host_compute=False, persistent=persistent)
        self.min_bytes = int(min_bytes)
        self._storages = _Storages(self)
        # Storages PyTorch freed are forgotten before the runtime acts at any boundary.
        self.runtime.at_boundary = self._storages.collect
        self._mode = None
        self._hook = None
        self._optimizers = weakref.WeakSet()
        self._manual = False

    # --- user API -------------------------------------------------------------------------
    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self._mode = _OffloadMode(self)
        self._mode.__enter__()
        self._hook = register_optimizer_step_post_hook(self._after_optimizer_step)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.runtime._in_iteration:
                self._end_iteration(failed=exc_type is not None)
        finally:
            self._hook.remove()
            self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
        self._restore_all()
        return False

    def step(self):
        """A context manager marking one iteration explicitly (for loops without an
        optimizer ``step()``)."""
        driver = self

        class _Step:
            def __enter__(self):
                driver._manual = True
                driver._begin_iteration()
                return driver

            def __exit__(self, exc_type, exc, tb):
                driver._end_iteration(failed=exc_type is not None)
                driver._manual = False
                return False
        return _Step()

    def stats(self) -> dict:
        return self.runtime.stats()

    # --- internals ----------------------------------------------------------------------
    def _tracked(self, t):
        torch = _torch()
        return (isinstance(t, torch.Tensor) and t.device.type == self.device_type
                and not t.is_sparse and t.untyped_storage().nbytes() >= self.min_bytes)

    def _persistent_storages(self):
        """Parameters and optimizer state of the optimizers seen so far."""
        out = []
        for opt in list(self._optimizers):
            for group in opt.param_groups:
                out.extend(group["params"])
            for state in opt.state.values():
                out.extend(v for v in state.values() if hasattr(v, "untyped_storage"))
        return out

    def _begin_iteration(self):
        self._storages.collect()
        for t in self._persistent_storages():
            if self._tracked(t):
                buf = self._storages.buffer(t.untyped_storage(), persistent=True)
                buf.persistent = True   # adopted as transient before its optimizer stepped
        self.runtime._begin_iteration()

    def _end_iteration(self, failed=False):
        self._storages.collect()
        self.runtime._end_iteration(failed=failed)

    def _after_optimizer_step(self, optimizer, args, kwargs):
        new = optimizer not in self._optimizers
        self._optimizers.add(optimizer)
        if self.runtime._in_iteration and not self._manual:
            self._end_iteration()
        if new:
            # First sight of this optimizer: its parameters and state were recorded as
            # transient, so the record is wrong: record again next iteration.
            self.runtime._diverge()

    def _restore_all(self):
        """Leaving: every tracked storage back on the device, the backend's copies dropped."""
        rt = self.runtime
        rt.budget = None      # everything comes back, whatever the budget
        self._storages.collect()
        for buf in list(rt._buffers.values()):
            if buf.where == "swapping_out":
                rt._wait(buf)
            if buf.where == "on_host":
                rt._swap_in(buf, on_demand=True)
            if buf.where == "swapping_in":
                rt._wait(buf)

    def _dispatch(self, func, args, kwargs):
        from torch.utils._pytree import tree_flatten
        if func.is_view or func.overloadpacket.__name__ in _SKIP:
            return func(*args, **kwargs)
        name = str(func)
        rt = self.runtime
        self._storages.collect()
        schema_args = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema_args[len(args):]
                               if a.name in kwargs]
        tracked = []      # (tensor, is_write)
        for i, value in enumerate(values):
            is_write = (i < len(schema_args) and schema_args[i].alias_info is not None
                        and schema_args[i].alias_info.is_write)
            for t in tree_flatten(value)[0]:
                if self._tracked(t):
                    tracked.append((t, is_write))
        if not tracked:
            # Nothing tracked to make resident: run the op, then report what it created.
            out = func(*args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if self._tracked(t)]
            if outs:
                self._ensure_iteration()
                new = self._new_buffers(outs, ())
                with rt.function(writes=new, name=name):
                    pass
            return out
        self._ensure_iteration()      # before adopting: inside an iteration, transient
        reads, writes = [], []
        for t, is_write in tracked:
            buf = self._storages.buffer(t.untyped_storage())
            if buf not in reads:
                reads.append(buf)
            if is_write and buf not in writes:
                writes.append(buf)
        with rt.function(reads=reads, writes=writes, name=name):
            out = func(*args, **kwargs)
            new = self._new_buffers([t for t in tree_flatten(out)[0] if self._tracked(t)],
                                    reads)
            if new:
                rt.add_writes(new)
        return out

    def _ensure_iteration(self):
        if not self.runtime._in_iteration and not self._manual:
            self._begin_iteration()

    def _new_buffers(self, tensors, known_bufs):
        known = set(id(b) for b in known_bufs)
        new = []
        for t in tensors:
            buf = self._storages.buffer(t.untyped_storage())
            if id(buf) not in known:
                known.add(id(buf))
                new.append(buf)
        return new


def _make_mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OffloadModeImpl(TorchDispatchMode):
        def __init__(self, driver):
            super().__init__()
            self.driver = driver

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return self.driver._dispatch(func, args, kwargs or {})

    return _OffloadModeImpl


_mode_class = None


def _OffloadMode(driver):
    global _mode_class
    if _mode_class is None:
        _mode_class = _make_mode_class()
    return _mode_class(driver)


def out_of_core(budget=None, scheduler="window", window=None, backend=None,
                min_bytes=64 << 10, device=None, allocator=None,
                persistent="resident") -> OutOfCore:
    """Turns on out-of-core training for the steps run inside ``with``::

        with vmalloc.torch.out_of_core(budget="12GiB") as ooc:
            for x, y in loader:
                loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        print(ooc.stats())
    """
    return OutOfCore(budget=budget, scheduler=scheduler, window=window, backend=backend,
                     min_bytes=min_bytes, device=device, allocator=allocator,
                     persistent=persistent)
