"""Recompute in the PyTorch driver: the ``rerun`` of a recorded aten op (issue 16).

The runtime recomputes a dropped storage by calling its producer's rerun (see
:mod:`vmalloc.offload.runtime.recompute`). For PyTorch, the rerun re-dispatches the aten op with
the same input tensors (the runtime makes their storages resident first, and has kept them
unchanged) and copies the result into the output's storage, below autograd, with no dispatch
mode active, so the program's tensors, version counters and autograd graph never notice.

Only ops that give the same bits again qualify: functional (no mutable or ``out=`` argument),
not seeded-random (``nondeterministic_seeded``; dropout's mask comes from an RNG); on CUDA only
the element-wise ops of :data:`CUDA_BITWISE` (atomics make index_add, scatter_add and many
backward kernels differ run to run, and no tag marks them), plus convolutions and matrix
products when ``torch.use_deterministic_algorithms(True)`` is on (then PyTorch itself picks
deterministic kernels or raises); one fresh output. A tensor argument whose storage the driver
tracks is held by weak reference to its storage, with its view of it (the runtime keeps the
storage unchanged while the output is dropped; the tensor object itself may be a temporary);
an untracked one (below ``min_bytes``: a convolution's weight, a bias) could change unseen, so
the rerun keeps a copy of it as the op read it (at most ``min_bytes`` each). The rerun never
keeps a tracked tensor alive that the program has let go of, and says (``ready()``) when it no
longer can run.
"""

from __future__ import annotations

import weakref


#: Element-wise aten ops whose CUDA kernels give the same bits for the same inputs.
CUDA_BITWISE = frozenset((
    "relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "elu", "add", "sub",
    "mul", "div", "neg", "exp", "clone", "_to_copy", "threshold"))
#: Deterministic on CUDA only under ``torch.use_deterministic_algorithms(True)``.
CUDA_IF_DETERMINISTIC = frozenset(("convolution", "mm", "addmm", "bmm", "linear"))


def rerunnable(func, device_type) -> bool:
    """Whether aten op ``func`` gives the same bits when re-run on the same inputs."""
    import torch

    schema = func._schema
    if schema.is_mutable or any(a.is_out for a in schema.arguments):
        return False
    tags = getattr(func, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags or \
            torch.Tag.nondeterministic_bitwise in tags:
        return False
    if device_type == "cpu":
        return True
    name = func._schema.name.split("::")[-1]
    return name in CUDA_BITWISE or (name in CUDA_IF_DETERMINISTIC
                                    and torch.are_deterministic_algorithms_enabled())


class _Ref:
    """A weak reference to a tracked tensor's *storage* and its view of it (offset, sizes,
    strides, dtype): the program's tensor object is often a temporary (``x.view(...)`` passed
    to an op, an op's output a later view replaces) that dies while its storage, which the
    runtime keeps, lives on; a weak reference to the object made the rerun unready then, and
    every planned drop of its output was refused. Calling it rebuilds a tensor over the storage
    (None once the storage is gone). A tensor whose view is more than its geometry (a subclass,
    conjugate or negative bits) is held by weak reference to itself, as before."""

    __slots__ = ("storage", "view", "tensor")

    def __init__(self, t):
        import torch

        self.storage = self.view = self.tensor = None
        if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_conj() and \
                not t.is_neg():
            self.storage = weakref.ref(t.untyped_storage())
            self.view = (t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)
        else:
            self.tensor = weakref.ref(t)

    def __call__(self):
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        if self.tensor is not None:
            return self.tensor()
        s = self.storage()
        if s is None:
            return None
        offset, size, stride, dtype = self.view
        with _disable_current_modes(), torch.no_grad():
            return torch.empty(0, dtype=dtype, device=s.device).set_(s, offset, size, stride)

    def alive(self) -> bool:
        ref = self.tensor if self.tensor is not None else self.storage
        return ref() is not None


class AtenRerun:
    """Re-runs ``func(*args, **kwargs)`` into ``out``'s storage (see the module docstring)."""

    __slots__ = ("func", "spec", "leaves", "out", "__weakref__")

    def __init__(self, func, args, kwargs, out, tracked):
        import torch
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_flatten

        leaves, self.spec = tree_flatten((args, kwargs))
        self.leaves = []
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                self.leaves.append((False, x))        # sizes, scalars, dtypes as they are
            elif tracked(x):
                self.leaves.append((True, _Ref(x)))
            else:
                with _disable_current_modes(), torch.no_grad():
                    self.leaves.append((False, x.detach().clone()))
        self.func = func
        self.out = _Ref(out)

    @staticmethod
    def make(func, args, kwargs, out, tracked):
        """The rerun of one op (``tracked(t)``: whether the driver tracks tensor t's
        storage)."""
        return AtenRerun(func, args, kwargs, out, tracked)

    def ready(self) -> bool:
        return self.out.alive() and all(ref.alive() for is_tensor, ref in self.leaves
                                        if is_tensor)

    def __call__(self, ptrs=None):
        import torch
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_unflatten

        values = []
        for is_tensor, x in self.leaves:
            if is_tensor:
                x = x()
                if x is None:
                    raise RuntimeError(f"an input of {self.func} is gone")
            values.append(x)
        out = self.out()
        if out is None:
            raise RuntimeError(f"the output of {self.func} is gone")
        args, kwargs = tree_unflatten(values, self.spec)
        with _disable_current_modes(), torch._C._AutoDispatchBelowAutograd(), \
                torch.no_grad():
            result = self.func(*args, **kwargs)
            # A fresh tensor over the output's storage: its own version counter, so the
            # program's tensor (saved for backward) sees no in-place write.
            target = torch.empty(0, dtype=out.dtype, device=out.device).set_(
                out.untyped_storage(), out.storage_offset(), out.size(), out.stride())
            target.copy_(result)
