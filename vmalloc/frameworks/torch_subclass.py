"""Tensors the PyTorch out-of-core driver does not see as plain tensors with storages.

- **Wrapper subclasses** (DTensor, ``TwoTensor``: a ``__torch_dispatch__`` of their own): their
  storage has no data. The dispatch mode lets their ``__torch_dispatch__`` run an op first
  (returning ``NotImplemented``); it runs the op on their inner tensors, which reach the mode,
  still active, as plain tensors and are tracked as any other. Parameters and optimizer state
  that are wrappers are tracked through their inner tensors (``__tensor_flatten__``).
- **FSDP2** (``fully_shard``): its parameters are DTensors (above); it frees and reallocates
  the unsharded parameters by ``UntypedStorage.resize_()``, outside the dispatcher, which the
  driver follows by patching ``resize_`` while it is active (``Readers`` and
  ``Storages.release`` in :mod:`vmalloc.frameworks.torch_state`).
"""

from __future__ import annotations


def is_wrapper(cls_or_tensor):
    """Whether a tensor (or tensor type) is a subclass with its own ``__torch_dispatch__``
    (a wrapper: DTensor, TwoTensor): its storage has no data pointer."""
    import torch
    cls = cls_or_tensor if isinstance(cls_or_tensor, type) else type(cls_or_tensor)
    impl = getattr(cls, "__torch_dispatch__", None)
    return issubclass(cls, torch.Tensor) and impl is not None and \
        getattr(impl, "__func__", impl) is not torch._C._disabled_torch_dispatch_impl


def plain_tensors(tensors):
    """``tensors`` with each wrapper subclass replaced by its inner tensors
    (``__tensor_flatten__``, recursively); a wrapper that cannot say is left out."""
    out = []
    stack = list(tensors)[::-1]
    while stack:
        t = stack.pop()
        if not is_wrapper(t):
            out.append(t)
            continue
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None:
            names = flatten()[0]
            stack.extend(getattr(t, n) for n in reversed(names))
    return out
