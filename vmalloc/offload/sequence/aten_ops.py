"""Which aten ops are functions, and which storages each reads and writes.

One set of rules for everything that watches PyTorch's aten ops through a dispatch mode: the
recorder (:mod:`vmalloc.offload.sequence.recorder`, on the meta device) and the out-of-core driver
(:mod:`vmalloc.frameworks.torch_out_of_core`, on live tensors).

- **Not functions**: pure view and metadata ops (the schema says ``func.is_view``, or the op is
  in :data:`METADATA`: ``aten.detach``, ``aten._unsafe_view``, ``aten.sym_size``...) and
  allocation-only ops (:data:`ALLOC_ONLY`: ``aten.empty*``: their content is undefined).
- **Reads and writes come from the schema**: an argument annotated mutable (``Tensor(a!)``) is
  written; it is read too unless it is an ``out=`` argument or the target of an op that
  overwrites it (:data:`OVERWRITE`: ``fill_``, ``zero_``, ``copy_``...) and it covers its whole
  storage. Every other tensor argument is read, except the template of ``ones_like``-style ops
  (:data:`SHAPE_ONLY_SELF`), which only lends its shape and dtype.
- **Outputs**: the returned tensors the schema does not mark as aliases of an argument are new
  storages (:func:`fresh_returns` tells how many, before the op runs).
- **Gradient accumulation**: eager autograd adds a second gradient into the first in place
  (``aten.add_``) when it holds the only reference, but under any dispatch mode it adds out of
  place (``aten.add.Tensor``): ``at::isTensorSubclassLike`` answers True for every tensor while a
  dispatch mode is enabled, and ``InputBuffer::accumulate`` then refuses the in-place path.
  :func:`is_accumulation` recognises such an add, so that a recorder can record what eager
  PyTorch runs.

torch is imported by the functions that need it, never by importing this module.
"""

from __future__ import annotations

__all__ = ["ALLOC_ONLY", "METADATA", "OVERWRITE", "SHAPE_ONLY_SELF", "accesses", "covers_storage",
           "fresh_returns", "is_accumulation", "is_function", "op_base"]

#: Ops that only allocate (their content is undefined): not functions.
ALLOC_ONLY = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
})
#: Ops that move no data and whose schema does not say so (views say so: ``func.is_view``).
METADATA = frozenset({
    "detach", "alias", "lift_fresh", "_unsafe_view", "_reshape_alias", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "set_", "resize_",
})
#: Ops that use their first argument's shape and dtype only, never its data.
SHAPE_ONLY_SELF = frozenset({
    "ones_like", "zeros_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_full",
})
#: In-place ops that overwrite their target without reading it (when it covers its storage).
OVERWRITE = frozenset({"fill_", "zero_", "copy_", "normal_", "uniform_", "random_",
                       "bernoulli_", "exponential_"})


def op_base(func) -> str:
    """``aten.add_.Tensor`` -> ``"add_"``."""
    return func._schema.name.split("::", 1)[-1]


def is_function(func) -> bool:
    """Whether the op reads or writes storage data (decided before it runs, from its schema
    and name)."""
    if func.is_view:
        return False
    base = op_base(func)
    return base not in ALLOC_ONLY and base not in METADATA


def covers_storage(t) -> bool:
    """Whether tensor ``t`` spans its whole storage, contiguously."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def accesses(func, args, kwargs):
    """Yields ``(tensor, read, written)`` for every tensor argument the op uses, in schema
    order (a tensor list yields each tensor)."""
    import torch

    base = op_base(func)
    npos = len(args)
    for i, a in enumerate(func._schema.arguments):
        if i < npos and not a.kwarg_only:
            v = args[i]
        elif a.name in kwargs:
            v = kwargs[a.name]
        else:
            continue
        if isinstance(v, torch.Tensor):
            ts = (v,)
        elif isinstance(v, (list, tuple)):
            ts = [x for x in v if isinstance(x, torch.Tensor)]
        else:
            continue
        if not ts or (i == 0 and base in SHAPE_ONLY_SELF):
            continue
        written = a.alias_info is not None and a.alias_info.is_write
        overwrite = written and (a.is_out or base in OVERWRITE)
        for t in ts:
            if t.layout != torch.strided:
                continue
            read = not written or not (overwrite and covers_storage(t))
            yield t, read, written


def fresh_returns(func) -> int:
    """How many of the op's returns are new tensors (not aliases of an argument)."""
    return sum(1 for r in func._schema.returns if r.alias_info is None)


def is_accumulation(func, args, kwargs) -> bool:
    """Whether the op is autograd adding one gradient into another out of place where eager
    PyTorch would add in place: ``aten.add.Tensor`` of two dense tensors of one shape, dtype
    and layout, alpha 1, run by the autograd engine with grad mode off, the first not a view.
    The caller checks the last condition eager checks: nothing else holds the first operand
    (it is never used again)."""
    import torch

    if str(func) != "aten.add.Tensor" or kwargs.get("alpha", 1) != 1 or len(args) != 2:
        return False
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1:
        return False   # not the engine accumulating (or a double-backward graph is built)
    # A view shares its storage with its base, which eager's use-count test refuses (the tied
    # embedding of GPT-2: the output layer's weight gradient arrives as a view).
    return (not a._is_view() and a.shape == b.shape and a.dtype == b.dtype
            and a.layout == torch.strided
            and b.layout == torch.strided and a.device == b.device
            and (a.is_contiguous() or a.is_contiguous(memory_format=torch.channels_last)))
