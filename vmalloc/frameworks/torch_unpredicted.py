"""Ops whose outputs' bytes the PyTorch out-of-core driver cannot predict before they run.

The driver makes room for an op's outputs before it runs, from their sizes worked out on the
meta device; an op without a meta kernel (a custom op without a fake kernel, some backends'
ops) cannot be predicted. Its outputs are measured after it ran instead, and an op that took
the device past the budget is counted and said (raised under ``strict``), never silent.
"""

from __future__ import annotations


class Unpredicted:
    """Ops whose outputs' bytes no meta kernel predicts: measured after they run (the bytes
    of the storages they created). When the device then holds more than the budget, the op
    ran over it: counted in ``over_budget_ops`` and said once (raised under strict). The
    measure is kept per op and argument shapes, so that the next run makes room first."""

    def __init__(self, driver):
        self.driver = driver
        self.sizes = {}      # (op, shapes and scalars of its arguments) -> measured bytes

    @staticmethod
    def _key(func, args, kwargs):
        import torch
        from torch.utils._pytree import tree_flatten

        def part(x):
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype, x.device.type)
            return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)
        return (str(func),) + tuple(part(x) for x in tree_flatten((args, kwargs))[0])

    def measured(self, func, args, kwargs):
        """The bytes an earlier run of this op on these shapes created, or None."""
        return self.sizes.get(self._key(func, args, kwargs))

    def ran(self, func, args, kwargs, nbytes, name):
        """The op ran (its new buffers reported to the runtime): ``nbytes`` created."""
        if len(self.sizes) < 4096:
            self.sizes[self._key(func, args, kwargs)] = nbytes
        rt = self.driver.runtime
        held = rt.stats()["device_bytes"]
        if nbytes and held > rt.budget:
            self._over_budget(name, nbytes, held)

    def _over_budget(self, name, nbytes, held):
        from vmalloc.errors import OutOfMemoryError
        driver = self.driver
        driver._counts["over_budget_ops"] += 1
        running = getattr(driver.runtime, "running_function", None)
        what = (running() if running is not None else None) or name
        message = (f"{what} created {nbytes} bytes of outputs, which no meta kernel "
                   f"predicted, and the device held {held} bytes, more than the budget of "
                   f"{driver.runtime.budget} bytes")
        if driver.strict:
            raise OutOfMemoryError(message + " (strict=True; the op ran, its outputs are "
                                   "dropped)", requested_bytes=nbytes)
        driver._say("over_budget", message + ": it ran over the budget (later runs of this "
                    "op on these shapes make room first)")
