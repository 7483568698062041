"""Ops whose outputs' bytes the PyTorch out-of-core driver cannot predict before they run.

The driver makes room for an op's outputs before it runs, from their sizes worked out on the
meta device; an op without a meta kernel (a custom op without a fake kernel) cannot be
predicted, and some meta kernels fall short (``aten.mkldnn_rnn_layer``'s, CPU LSTM: its real
workspace is far larger). What each op created is measured after it ran; one that created
more than room was made for, and took the device past the budget, is counted and said (raised
under ``strict``), never silent.
"""

from __future__ import annotations

import weakref


class Unpredicted:
    """Measures what each op created (the bytes of its new tracked storages) against the
    room made for it. An op that created more (no meta kernel, or one that falls short) and
    left the device above the budget ran over it: counted in ``over_budget_ops`` and said
    once (raised under strict). A short measure is kept per op and argument shapes, so that
    the next run makes room for it first."""

    def __init__(self, driver):
        self.driver = weakref.proxy(driver)   # (it holds this: no reference cycle)
        self.sizes = {}      # (op, shapes and scalars of its arguments) -> measured bytes

    @staticmethod
    def _key(func, args, kwargs):
        import torch
        from torch.utils._pytree import tree_leaves

        def part(x):
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype, x.device.type)
            return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)
        return (str(func),) + tuple(part(x) for x in tree_leaves((args, kwargs)))

    def measured(self, func, args, kwargs):
        """The bytes an earlier run of this op on these shapes created when its prediction
        fell short, or None."""
        return self.sizes.get(self._key(func, args, kwargs))

    def ran(self, func, args, kwargs, predicted, room, nbytes, name):
        """The op ran (its new buffers reported to the runtime): it created ``nbytes``;
        ``predicted`` on the meta device (None: no meta kernel), ``room`` made for."""
        if nbytes <= (room or 0):
            return
        if len(self.sizes) < 4096:
            self.sizes[self._key(func, args, kwargs)] = nbytes
        rt = self.driver.runtime
        held = rt.stats()["device_bytes"]
        if held > rt.budget:
            self._over_budget(name, predicted, nbytes, held)

    def _over_budget(self, name, predicted, nbytes, held):
        from vmalloc.errors import OutOfMemoryError
        driver = self.driver
        driver._counts["over_budget_ops"] += 1
        running = getattr(driver.runtime, "running_function", None)
        what = (running() if running is not None else None) or name
        why = ("which no meta kernel predicted" if predicted is None else
               f"where its meta kernel predicted {predicted}")
        message = (f"{what} created {nbytes} bytes of outputs, {why}, and the device held "
                   f"{held} bytes, more than the budget of {driver.runtime.budget} bytes")
        if driver.strict:
            raise OutOfMemoryError(message + " (strict=True; the op ran, its outputs are "
                                   "dropped)", requested_bytes=nbytes)
        driver._say("over_budget", message + ": it ran over the budget (later runs of this "
                    "op on these shapes make room first)")
