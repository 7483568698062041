"""Swap backends of the PyTorch out-of-core driver (:mod:`vmalloc.frameworks.torch_out_of_core`).

A backend has the :class:`~vmalloc.offload.SwapManager`'s methods (``swap_out``, ``swap_in``,
``wait``, ``state``, ``stats``) keyed by storage pointers, plus ``register`` / ``unregister``
(the driver tells it which storage lives at a pointer), ``discard`` (PyTorch freed a storage
whose bytes are on the host) and ``tracks(ptr, nbytes)`` (whether the backend can swap that
storage without moving it). ``asynchronous`` (default False) says that a swap-out's copy runs
while the host goes on, so the steady state under pressure waits for it only at its next
boundary that works (:mod:`vmalloc.frameworks.torch_pressure`), not at once.
"""

from __future__ import annotations

import contextlib
import weakref

from vmalloc.errors import InvalidArgumentError


def _live(refs):
    """The first storage still alive among weak references, or None."""
    for ref in refs:
        storage = ref()
        if storage is not None:
            return storage
    return None


class PoisonSwap:
    """The ``"poison"`` backend: swaps CPU storages by copying them aside and poisoning them.

    A swap-out copies a storage's bytes aside and overwrites the storage with 0xFF bytes (NaN
    for floats); a swap-in restores them. Keys are storage addresses (a CPU storage keeps its
    address while swapped); two storages over one buffer (``torch.from_numpy`` twice) share
    it. Copies are synchronous, so every swap is complete when issued; states still follow the
    SwapManager's (``swapping_out`` until waited), so the runtime's protocol is exercised in
    full.

    A host copy whose storage came back is kept for the next swap-out of as many bytes (a
    fresh allocation per swap cost more than the copy itself: measured, docs/benchmarks.md),
    as long as the live and kept copies together stay within the most the live ones ever
    held (``host_bytes_kept``; ``host_copies_reused`` counts the reuses).
    """

    #: Copies are synchronous: a swap is complete when issued.
    asynchronous = False

    def __init__(self):
        self._storages = {}   # ptr -> [storage weakref]
        self._host = {}       # ptr -> saved bytes (a uint8 tensor)
        self._state = {}      # ptr -> state, absent = resident
        self._stats = dict(bytes_swapped_out=0, bytes_swapped_in=0, swap_outs=0, swap_ins=0,
                           host_copies_reused=0)
        self._spare = {}      # nbytes -> [uint8 tensors no storage's bytes are in]
        self._live = self._kept = self._peak = 0   # host bytes: in copies, spare, most live

    def tracks(self, ptr, nbytes):
        return True

    def register(self, ptr, storage):
        # Weak: the backend must not keep a storage PyTorch has freed alive.
        refs = [r for r in self._storages.get(ptr, ()) if r() is not None]
        refs.append(weakref.ref(storage))
        self._storages[ptr] = refs

    def unregister(self, ptr, storage=None):
        refs = [r for r in self._storages.get(ptr, ()) if r() is not None
                and r() is not storage]
        if refs:
            self._storages[ptr] = refs
        else:
            self._storages.pop(ptr, None)

    def _bytes(self, ptr):
        """A byte view of the storage at ptr, or None if PyTorch has freed it."""
        import torch
        storage = _live(self._storages.get(ptr, ()))
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def state(self, key):
        return self._state.get(key, "resident")

    def _copy(self, view):
        """The host copy of a byte view: into a kept tensor of its size, else a new one."""
        n = view.numel()
        spares = self._spare.get(n)
        if spares:
            host = spares.pop()
            if not spares:
                del self._spare[n]
            self._kept -= n
            host.copy_(view)
            self._stats["host_copies_reused"] += 1
        else:
            host = view.clone()
        self._live += n
        self._peak = max(self._peak, self._live)
        while self._live + self._kept > self._peak:     # (kept of other sizes: dropped)
            size, spares = next(iter(self._spare.items()))
            spares.pop()
            self._kept -= size
            if not spares:
                del self._spare[size]
        return host

    def _drop(self, host):
        """A host copy no storage's bytes are in any more: kept for reuse within the peak."""
        if host.dtype != _uint8():
            return      # (a compressed copy: not of a storage's size)
        n = host.numel()
        self._live -= n
        if self._live + self._kept + n <= self._peak:
            self._spare.setdefault(n, []).append(host)
            self._kept += n

    def swap_out(self, ptr, stream=0):
        if self.state(ptr) != "resident":
            raise InvalidArgumentError(f"swap_out: {ptr:#x} is {self.state(ptr)}")
        with _modes_off():
            view = self._bytes(ptr)
            if view is None:
                raise InvalidArgumentError(f"swap_out: the storage at {ptr:#x} was freed")
            self._host[ptr] = self._copy(view)
            self._poison(ptr, view)
        self._state[ptr] = "swapping_out"
        self._stats["bytes_swapped_out"] += view.numel()
        self._stats["swap_outs"] += 1
        return ptr

    def swap_out_compressed(self, ptr, nbytes, fmt, stream=0):
        """A swap-out of a float32 storage as fp16 or bf16 (``fmt``): the host copy is cast
        on the copy side (half the bytes), the swap-in casts back (``copy_``)."""
        from torch.utils._python_dispatch import _disable_current_modes
        if self.state(ptr) != "resident":
            raise InvalidArgumentError(f"swap_out: {ptr:#x} is {self.state(ptr)}")
        with _disable_current_modes():
            view = self._bytes(ptr)
            if view is None:
                raise InvalidArgumentError(f"swap_out: the storage at {ptr:#x} was freed")
            self._host[ptr] = _as_float32(view).to(_half_dtype(fmt))
            self._poison(ptr, view)
        self._state[ptr] = "swapping_out"
        self._stats["bytes_swapped_out"] += self._host[ptr].numel() * 2
        self._stats["swap_outs"] += 1
        self._stats["compressed_swap_outs"] = self._stats.get("compressed_swap_outs", 0) + 1
        return ptr

    def compressed(self, key):
        host = self._host.get(key)
        return host is not None and host.dtype != _uint8()

    def wait(self, key, stream=0):
        state = self.state(key)
        if state == "swapping_out":
            self._state[key] = "on_host"
        elif state == "swapping_in":
            del self._state[key]
        else:
            raise InvalidArgumentError(f"wait: {key:#x} has no copy in flight ({state})")

    def swap_in(self, key, stream=0):
        state = self.state(key)
        if state not in ("on_host", "swapping_out"):
            raise InvalidArgumentError(f"swap_in: {key:#x} is {state}")
        with _modes_off():
            view = self._bytes(key)
            if view is None:
                raise InvalidArgumentError(f"swap_in: the storage at {key:#x} was freed")
            host = self._host[key]
            # The host copy goes only once the copy that restores the storage has completed:
            # a failed copy leaves it on the host, to be swapped in again.
            self._copy_back(view, host)
            del self._host[key]
            self._drop(host)
            if host.dtype != view.dtype:
                self._stats["compressed_swap_ins"] = \
                    self._stats.get("compressed_swap_ins", 0) + 1
        if state == "swapping_out":
            del self._state[key]      # cancelled: nothing left in flight
        else:
            self._state[key] = "swapping_in"
            self._stats["bytes_swapped_in"] += host.numel() * host.element_size()
            self._stats["swap_ins"] += 1
        return key

    def _poison(self, ptr, view):
        """Overwrites a storage whose bytes were copied aside; a failure restores them (and
        drops the copy): the storage stays resident, unchanged; if the restore fails too, the
        storage is on the host."""
        try:
            view.fill_(255)
        except BaseException as first:
            try:
                self._copy_back(view, self._host[ptr])
            except BaseException:
                # The bytes are kept: on the host, and swap_in restores them (the runtime
                # follows the backend's state). The first error is the one raised.
                self._state[ptr] = "on_host"
                raise first from None
            self._drop(self._host.pop(ptr))
            raise

    @staticmethod
    def _copy_back(view, host):
        """Restores a storage (a byte view) from its host copy; casts a compressed one back."""
        if host.dtype == view.dtype:
            view.copy_(host)
        else:
            _as_float32(view).copy_(host)

    def discard(self, key):
        host = self._host.pop(key, None)
        if host is not None:
            self._drop(host)
        self._state.pop(key, None)

    def release(self, key, stream=0):
        """A storage the runtime will recompute: poisoned, no copy (its bytes are not kept)."""
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            view = self._bytes(key)
            if view is None:
                raise InvalidArgumentError(f"release: the storage at {key:#x} was freed")
            view.fill_(255)
        self._stats["bytes_released"] = self._stats.get("bytes_released", 0) + view.numel()

    def rematerialize(self, key, stream=0):
        """Nothing to map on the CPU: the recompute overwrites the poison."""

    def stats(self):
        out = dict(self._stats)
        out["host_bytes"] = sum(t.numel() * t.element_size() for t in self._host.values())
        out["host_bytes_kept"] = self._kept
        return out


def _modes_off():
    """No dispatch mode for the backend's own copies: PyTorch's context that pops them, or
    none when none is pushed (the steady state: the context alone cost ~5 us a swap)."""
    import torch
    if torch._C._len_torch_dispatch_stack() == 0:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def holds_beyond_budget(allocator, budget):
    """Why the GPU may hold more physical memory than ``budget`` while the runtime keeps it,
    or None. The virtual allocator's default creates chunks before it steals cached ones;
    with no budget of its own it then keeps the unmapped chunks of swapped-out tensors cached
    while creating new ones (measured on an H200: 58.9 GB held at a 7.3 GB budget, GPT-2;
    docs/benchmarks.md, "On a real GPU")."""
    if budget is None or getattr(allocator, "budget", None) is not None \
            or getattr(allocator, "steal_before_create", True):
        return None
    return ("out_of_core's budget bounds the bytes the runtime keeps, but the allocator PyTorch "
            "allocates from creates chunks before it steals cached ones and has no budget of "
            "its own: the chunks of swapped-out tensors stay cached while new ones are "
            "created, so the GPU may hold far more than the budget. Create it with "
            "vmalloc.VirtualAllocator(device, steal_before_create=True) (or a budget)")


def _uint8():
    import torch
    return torch.uint8


def _half_dtype(fmt):
    import torch
    if fmt not in ("fp16", "bf16"):
        raise InvalidArgumentError(f"unknown compression {fmt!r}; choose 'fp16' or 'bf16'")
    return torch.float16 if fmt == "fp16" else torch.bfloat16


def _as_float32(byte_view):
    """A uint8 tensor over a whole storage, seen as its float32 elements."""
    import torch
    if byte_view.numel() % 4:
        raise InvalidArgumentError(f"a float32 storage has a multiple of 4 bytes, not "
                                   f"{byte_view.numel()}")
    return byte_view.view(torch.float32)


class CudaSwap:
    """The ``"cuda"`` backend: the :class:`~vmalloc.offload.SwapManager` over the vmalloc
    allocator PyTorch allocates from, keyed by storage pointers.

    Only storages whose allocation owns whole chunks of the virtual allocator (chunks
    placement, above its ``small_threshold``) are swapped: their pointer never changes, so
    PyTorch never notices. A storage sharing chunks (the small-block arena) would be relocated
    by a swap, behind PyTorch's back; :meth:`tracks` says no for it, so the driver never
    adopts it (asked of the allocator itself: ``owns_chunks``). An allocator that relocates
    every swap (caching, packed placement) is refused when the backend is made.

    While a storage is not resident the backend holds it, so PyTorch cannot free memory whose
    bytes are on the host; the hold ends when its swap-in is waited.
    """

    #: A swap-out copies on the manager's stream after the work queued before it; the host
    #: waits only in ``wait`` (a wait at once would drain the GPU's queue at every swap-out).
    asynchronous = True

    def __init__(self, manager, allocator):
        if not hasattr(allocator, "owns_chunks") or \
                getattr(allocator, "placement", "chunks") != "chunks":
            raise InvalidArgumentError(
                f"backend='cuda' needs the virtual allocator with placement='chunks' (PyTorch's "
                f"pointers must not move); {allocator!r} relocates what it swaps")
        self.manager = manager
        self.allocator = allocator
        #: Storages this small always share chunks (derived from the allocator).
        self.min_bytes = int(allocator.small_threshold) + 1
        self._owns = {}     # (ptr, nbytes) -> owns_chunks, for live storages
        self._weak = {}     # ptr -> storage weakref
        self._held = {}     # ptr -> storage, while not resident

    def tracks(self, ptr, nbytes):
        if nbytes < self.min_bytes:
            return False
        key = (ptr, nbytes)
        owns = self._owns.get(key)
        if owns is None:
            owns = self._owns[key] = bool(self.allocator.owns_chunks(ptr))
        return owns

    def register(self, ptr, storage):
        self._weak[ptr] = weakref.ref(storage)

    def unregister(self, ptr, storage=None):
        for key in [k for k in self._owns if k[0] == ptr]:
            del self._owns[key]
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
        if ptr != key:   # cannot happen for a storage tracks() accepted
            raise InvalidArgumentError(
                f"the storage at {key:#x} was relocated to {ptr:#x}: PyTorch's pointers must "
                "not move")
        if self.manager.state(ptr) == "resident":
            self._held.pop(ptr, None)
        return ptr

    def discard(self, key):
        # A held storage cannot have been freed; nothing else reaches here.
        self._held.pop(key, None)

    def release(self, key, stream=0):
        """A storage the runtime will recompute: its chunks unmapped after the work queued on
        ``stream``, no copy (the address stays reserved: PyTorch's pointer stays valid;
        touching it faults until rematerialize)."""
        self.allocator.unmap_backing(key, stream=stream)

    def rematerialize(self, key, stream=0):
        self.allocator.map_backing(key, stream=stream)

    def relocates(self, ptr):
        return not self.allocator.owns_chunks(ptr)

    def stats(self):
        return self.manager.stats()
