"""What the PyTorch out-of-core driver keeps beside the Runtime: which runtime buffer holds
each storage, the dispatch mode, and what bypasses the dispatcher: readers (``.numpy()``,
``.tolist()``, ``torch.save``) and ``UntypedStorage.resize_`` (FSDP2)."""

from __future__ import annotations

import sys
import threading
import weakref


class Storages:
    """Storage -> runtime buffer, keyed by the storage's address: two storages over one buffer
    (``torch.from_numpy`` twice) share one runtime buffer. Finalizers report freed storages;
    :meth:`collect` forgets their buffers at the driver's next boundary (finalizers run
    anywhere, the runtime is not reentrant)."""

    def __init__(self, driver):
        self.driver = weakref.proxy(driver)   # (it holds this: no reference cycle)
        self.by_ptr = {}        # ptr -> [buffer, [storage weakrefs], iteration adopted]
        self.dead = []          # ptrs whose storages died

    def _entry(self, storage):
        ptr = storage.data_ptr()
        entry = self.by_ptr.get(ptr)
        if entry is None:
            return ptr, None
        refs = [r for r in entry[1] if r() is not None]
        if not refs:            # every storage there died: a new allocation at that address
            self._forget(ptr)
            return ptr, None
        entry[1] = refs
        if not any(r() is storage for r in refs):
            entry[1].append(weakref.ref(storage))     # one more storage over the buffer
            weakref.finalize(storage, self.dead.append, ptr)
            register = getattr(self.driver.backend, "register", None)
            if register is not None:
                register(ptr, storage)
        return ptr, entry

    def known(self, storage):
        """The buffer of a storage the driver tracks already, or None."""
        entry = self._entry(storage)[1]
        return entry[0] if entry is not None else None

    def iteration_of(self, buf):
        entry = self.by_ptr.get(buf.ptr)
        return entry[2] if entry is not None and entry[0] is buf else self.driver._iteration

    def buffer(self, storage, persistent=None, dtype=None):
        """The buffer of a storage (adopted on first sight). ``dtype``: a dtype the program
        sees it as, noted under compression (a storage seen as several is never compressed)."""
        ptr, entry = self._entry(storage)
        if entry is not None:
            if dtype is not None and self.driver.compress is not None:
                self.driver.runtime.note_dtype(entry[0], dtype)
            return entry[0]
        if self.driver.compress is None:
            dtype = None    # the default path: nothing noted
        buf = self.driver.runtime.adopt(ptr, storage.nbytes(), persistent=persistent,
                                        dtype=dtype)
        register = getattr(self.driver.backend, "register", None)
        if register is not None:
            register(ptr, storage)
        self.by_ptr[ptr] = [buf, [weakref.ref(storage)], self.driver._iteration]
        weakref.finalize(storage, self.dead.append, ptr)
        return buf

    def make_persistent(self, buf):
        """Re-adopts a live transient buffer as persistent (outside an iteration): resident
        first, so that forgetting it drops no bytes."""
        rt = self.driver.runtime
        entry = self.by_ptr.get(buf.ptr)
        if entry is None or entry[0] is not buf or not buf.alive:
            return
        if buf.state != "resident":
            rt.enter_function((buf,), (), name="vmalloc.persistent")
            rt.exit_function()
        rt.forget(buf)
        entry[0] = rt.adopt(buf.ptr, buf.nbytes, persistent=True)

    def collect(self):
        """Forgets the buffers of storages PyTorch freed."""
        while self.dead:
            ptr = self.dead.pop()
            entry = self.by_ptr.get(ptr)
            if entry is not None and not any(r() is not None for r in entry[1]):
                self._forget(ptr)

    def _forget(self, ptr, freed=True):
        entry = self.by_ptr.pop(ptr)
        self.driver.runtime.forget(entry[0], freed=freed)
        unregister = getattr(self.driver.backend, "unregister", None)
        if unregister is not None:
            unregister(ptr)   # only if no live storage took the address

    def release(self, storage, nbytes):
        """``storage`` is about to change size to ``nbytes`` (``resize_``, outside the
        dispatcher): its buffer leaves the runtime, with its bytes (swapped back in first)
        unless it shrinks to nothing, and no storage is left registered at its old address
        (every storage object there is this one's memory, which moves). After the resize it
        is adopted anew at its next op."""
        ptr = storage.data_ptr()
        entry = self.by_ptr.get(ptr) if ptr else None
        if entry is None:
            return
        buf = entry[0]
        if nbytes and buf.alive and buf.state != "resident" and \
                not self.driver._make_room(buf.nbytes):
            self.driver._over_budget("resize_", buf.nbytes, unseen=True)
        self._forget(ptr, freed=not nbytes)    # resize_(0) keeps no byte: nothing comes back
        unregister = getattr(self.driver.backend, "unregister", None)
        if unregister is not None:
            for ref in entry[1] + [weakref.ref(storage)]:
                if ref() is not None:
                    unregister(ptr, ref())

    def buffers(self, tensors):
        """The buffers of the tracked storages among ``tensors``."""
        from vmalloc.frameworks.torch_subclass import plain_tensors
        out = []
        for t in plain_tensors(tensors):
            if self.driver._tracked(t):
                buf = self.known(t.untyped_storage())
                if buf is not None and buf not in out:
                    out.append(buf)
        return out


def leaving(exc_type, *steps, exc=None):
    """Runs a block's last steps. Left by the program's exception, that exception is what
    propagates: a failure here (a storage that cannot be recomputed, a backend that cannot
    restore) is a warning, once, and a note on the program's exception where Python has notes
    (3.11+). Left normally, the first failure is raised after every step has run."""
    import warnings

    first = None
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - never mask the program's own error
            if exc_type is None:
                first = first or error
                continue
            if exc is not None and hasattr(exc, "add_note"):
                exc.add_note(f"leaving vmalloc.torch.out_of_core also failed: "
                             f"{type(error).__name__}: {error}")
            warnings.warn(f"leaving out_of_core after {exc_type.__name__} failed too: "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
    if first is not None:
        try:
            raise first
        finally:
            first = None   # (this frame, in its traceback, would hold it: a cycle)


def make_mode(driver):
    from torch.utils._python_dispatch import TorchDispatchMode

    global _mode_class
    if _mode_class is None:
        class _OffloadMode(TorchDispatchMode):
            def __init__(self, driver):
                super().__init__()
                self.driver = driver

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from vmalloc.frameworks.torch_subclass import is_wrapper
                wrappers = [t for t in types if is_wrapper(t)]
                if wrappers:
                    if all(hasattr(t, "__tensor_flatten__") for t in wrappers):
                        # A wrapper subclass (DTensor, TwoTensor) has no data of its own: its
                        # __torch_dispatch__ runs the op on its inner tensors, which come
                        # back here (the mode stays active) as plain tensors, tracked.
                        return NotImplemented
                    # Another mode's tensors (FakeTensor: no data either): theirs to run.
                    return func(*args, **(kwargs or {}))
                return self.driver._dispatch(func, args, kwargs or {})

        _mode_class = _OffloadMode
    return _mode_class(driver)


_mode_class = None


class Readers:
    """Reading a tensor outside an op (``.numpy()``, ``.tolist()``, ``np.asarray``,
    ``torch.save``) bypasses the dispatcher: while the driver is active those readers first
    swap the storages they read in. ``UntypedStorage.resize_`` (FSDP2 frees and reallocates
    parameters with it) bypasses it too: a resized storage's buffer leaves the runtime first
    (:meth:`Storages.release`). Also says, once, that ``torch.compile``'d regions run eager
    inside ``out_of_core`` (Dynamo skips frames while a dispatch mode is active)."""

    _METHODS = ("numpy", "tolist", "__array__")

    def __init__(self, driver):
        self.driver = weakref.proxy(driver)   # (it holds this: no reference cycle)
        self.saved = {}
        self.check_compiled = True

    def install(self):
        import torch
        import torch.serialization

        driver = self.driver
        for name in self._METHODS:
            original = getattr(torch.Tensor, name)
            self.saved[(torch.Tensor, name)] = original

            def reader(t, *args, _original=original, **kwargs):
                driver._readers.resident([t])
                return _original(t, *args, **kwargs)
            reader.__name__ = name
            setattr(torch.Tensor, name, reader)
        original_save = torch.serialization.save

        def save(obj, *args, **kwargs):
            driver._readers.resident(None)
            return original_save(obj, *args, **kwargs)
        for module in (torch, torch.serialization):
            self.saved[(module, "save")] = getattr(module, "save")
            setattr(module, "save", save)
        original_resize = torch.UntypedStorage.resize_
        thread = threading.get_ident()

        def resize_(storage, size, *args, **kwargs):
            # FSDP2 frees and reallocates unsharded parameters this way: a storage whose
            # size changes is another buffer (its old one leaves first). Another thread's
            # storages are not the driver's (its dispatch mode is this thread's).
            if threading.get_ident() == thread and not driver.runtime.in_function:
                driver._resized += 1      # (no steady state: torch_steady)
                driver._storages.collect()
                driver._storages.release(storage, int(size))
            return original_resize(storage, size, *args, **kwargs)
        self.saved[(torch.UntypedStorage, "resize_")] = original_resize
        torch.UntypedStorage.resize_ = resize_

    def remove(self):
        for (owner, name), value in self.saved.items():
            setattr(owner, name, value)
        self.saved.clear()

    def resident(self, tensors):
        """The storages of ``tensors`` (None: every tracked storage) resident."""
        driver = self.driver
        rt = driver.runtime
        if rt.in_function:
            return
        pressure = driver._steady.pressure
        if pressure.active and pressure.reads(tensors):
            # Out by the replay, which the runtime does not know: back to the dispatch path
            # (everything back where the runtime has it) before the runtime brings it in.
            driver._steady.leave("steady state under pressure: a storage it swapped out was "
                                 "read outside an op", now=True)
        driver._storages.collect()
        if tensors is None:
            # torch.save reads every storage while it pickles: all of them back at once,
            # whatever the budget (the next function's eviction restores it).
            rt.restore_all()
            return
        bufs = driver._storages.buffers(tensors)
        bufs = [b for b in bufs if b.alive and b.state != "resident"]
        if not bufs:
            return
        rt.enter_function(bufs, (), name="vmalloc.read")
        rt.exit_function()

    def compiled_region(self):
        """Warns once when an op runs inside a ``torch.compile``'d function (run eager)."""
        if "torch._dynamo" not in sys.modules:
            return
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "compile_wrapper" and \
                    code.co_filename.endswith("eval_frame.py"):
                self.check_compiled = False
                self.driver._say(
                    "compile", "torch.compile'd code runs eager inside vmalloc.torch."
                    "out_of_core: PyTorch's Dynamo skips every frame while a dispatch mode is "
                    "active, so compiled regions run op by op (correct, not compiled); for compiled "
                    "training, plan with vmalloc.torch.policy outside the block",
                    budget=False)
                return
            frame = frame.f_back


class Kinds:
    """Which storages the driver calls activations: the only ones the runtime may compress
    (``Runtime.set_kind``; every other storage stays ``"unknown"``, never compressed).

    A storage is marked an activation when an op creates it, outside an optimizer step, and
    only if the storage created at the same position of the previous iteration turned out to
    be one: it died within its iteration and no optimizer step saw it as a gradient (the
    pre-step hook takes the mark back from the stepping optimizer's gradients, parameters and
    state). So the first iteration compresses nothing: the driver does not know yet which
    storages are parameters, gradients, optimizer state or outlive their iteration."""

    def __init__(self, driver):
        self.driver = weakref.proxy(driver)   # (it holds this: no reference cycle)
        self.in_step = 0
        self.fresh = []        # this iteration's created storages' buffers (None: in a step)
        self.index = {}        # id(buffer) -> its position in fresh
        self.revoked = set()   # positions found not to be activations this iteration
        self.learned = frozenset()   # positions that were activations last iteration

    def begin(self):
        """At an iteration's start (after the freed storages were collected): learns which
        positions held activations; a storage that outlived its iteration is no activation."""
        rt = self.driver.runtime
        learned = set()
        for j, buf in enumerate(self.fresh):
            if buf is None or j in self.revoked:
                continue
            if buf.alive:
                if buf.kind == "activation":
                    rt.set_kind(buf, "unknown")     # lives across iterations
            else:
                learned.add(j)
        self.learned = frozenset(learned)
        self.fresh, self.index, self.revoked = [], {}, set()

    def created(self, buf):
        """An op created the storage of ``buf`` (a new transient buffer)."""
        j = len(self.fresh)
        candidate = self.in_step == 0 and not buf.persistent
        self.fresh.append(buf if candidate else None)
        self.index[id(buf)] = j
        if candidate and j in self.learned:
            self.driver.runtime.set_kind(buf, "activation")

    def revoke(self, buf, kind):
        j = self.index.get(id(buf))
        if j is not None:
            self.revoked.add(j)
        if buf.alive and buf.kind != kind:
            self.driver.runtime.set_kind(buf, kind)

    def before_step(self, optimizer):
        """An optimizer is about to step: what it touches is no activation."""
        known = self.driver._storages.known
        for group in optimizer.param_groups:
            for p in group["params"]:
                for t, kind in ((p, "parameter"), (getattr(p, "grad", None), "gradient")):
                    if t is not None and self.driver._tracked(t):
                        buf = known(t.untyped_storage())
                        if buf is not None:
                            self.revoke(buf, kind)
        for state in optimizer.state.values():
            for v in state.values():
                if hasattr(v, "untyped_storage") and self.driver._tracked(v):
                    buf = known(v.untyped_storage())
                    if buf is not None:
                        self.revoke(buf, "state")
        self.in_step += 1

    def after_step(self):
        self.in_step = max(0, self.in_step - 1)
