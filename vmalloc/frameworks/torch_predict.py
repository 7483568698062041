"""The bytes of tracked storages an aten op will create, worked out on the meta device before
it runs: the PyTorch out-of-core driver makes that much room first (allocation pressure).

A prediction depends only on the op, its tensors' shapes, strides, dtypes and devices and its
other arguments, so it is kept per such key: a training loop repeats the same ops on the same
shapes, and running an op on the meta device costs more than most CPU ops themselves (the
12-layer TransformerEncoder benchmark ran 533 predictions per step, about 150 us per aten op
of the step; kept, 40 in all). Arguments of any other kind (an object the key cannot hold)
are predicted every time.
"""

from __future__ import annotations

import sys

#: Predictions kept per driver (a bound: programs with ever-new shapes).
MAX_KEPT = 16384

_SCALARS = frozenset((int, float, bool, str, type(None), complex))


class _Unkeyed(Exception):
    """An argument the key cannot hold."""


def _part(x, torch):
    t = type(x)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return (x.shape, x.stride(), x.dtype, x.device.type)
    if t is tuple or t is list:
        return (t,) + tuple([_part(y, torch) for y in x])
    if t in _SCALARS or isinstance(x, (torch.dtype, torch.device, torch.memory_format,
                                       torch.layout)):
        return (t, x)
    if t is torch.Generator:
        return t           # (draws values, never sizes)
    raise _Unkeyed(t)      # (a tensor subclass, a dict, an object: predicted every time)


def _key(func, args, kwargs, torch):
    """(Written out rather than with pytree: flattening was most of a kept prediction.)"""
    try:
        return (func, _part(args, torch),
                tuple([(k, _part(v, torch)) for k, v in kwargs.items()]) if kwargs else ())
    except _Unkeyed:
        return None


def predicted_bytes(driver, func, args, kwargs):
    """Bytes of the tracked storages the op will create, worked out on the meta device before
    it runs (0: none; None: unknown, or no budget to keep)."""
    if driver.runtime.budget is None or func.namespace != "aten":
        return None
    if not any(str(r.type).startswith("Tensor") for r in func._schema.returns
               if r.alias_info is None):
        return 0
    torch = sys.modules["torch"]
    kept = driver._predictions
    key = _key(func, args, kwargs, torch)
    if key is not None and key in kept:
        return kept[key]
    total = _on_meta(driver, func, args, kwargs, torch)
    if key is not None and len(kept) < MAX_KEPT:
        kept[key] = total
    return total


def _on_meta(driver, func, args, kwargs, torch):
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_leaves, tree_map

    device = driver.device_type

    def to_meta(x):
        if isinstance(x, torch.Tensor):
            if x.device.type != device:
                return x
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.device) and x.type == device:
            return torch.device("meta")
        return x

    driver._counts["meta_predictions"] += 1
    try:
        with _disable_current_modes():
            margs, mkwargs = tree_map(to_meta, (tuple(args), dict(kwargs)))
            out = func(*margs, **mkwargs)
    except Exception:   # no meta kernel, or it mixes devices: learn the sizes after
        return None
    total = 0
    for t in tree_leaves(out):     # (tree_flatten: a reference cycle per call, torch 2.13)
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            n = t.untyped_storage().nbytes()
            if n >= driver.min_bytes:
                total += n
    return total
