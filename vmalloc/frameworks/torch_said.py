"""What the PyTorch out-of-core driver says when it cannot keep a promise (a budget no schedule
fits, an op whose own storages do not fit): once per block, as a warning pointing at the
program's line, or raised under ``strict``. Methods of
:class:`~vmalloc.frameworks.torch_out_of_core.OutOfCore` (assigned there)."""

from __future__ import annotations

import warnings


def unschedulable(self):
    """The runtime of this tree does not say that no schedule fits: say it (once)."""
    from vmalloc.offload.scheduling.schedule import ScheduleError
    error = getattr(self.runtime, "last_schedule_error", None)
    message = (f"no schedule fits the budget of {self.runtime.budget} bytes ({error}); "
               "iterations run on demand and may exceed the budget")
    if self.strict:
        raise ScheduleError(message)
    self._say("unschedulable", message)


def say(self, what, message, budget=True):
    """Says a broken promise once per block: about the budget through the runtime (one
    BudgetWarning per runtime, whoever finds the broken promise first), else a
    UserWarning; either points at the program's line."""
    import vmalloc.offload.runtime as runtime
    if what in self._said:
        return
    self._said.add(what)
    if budget and hasattr(self.runtime, "say_budget"):
        self.runtime.say_budget(message)
        return
    category = getattr(runtime, "BudgetWarning", UserWarning) if budget else UserWarning
    warn = getattr(runtime, "warn_user", None)
    if warn is not None:
        warn(message, category)
    else:
        warnings.warn(message, category, stacklevel=4)


def over_budget(self, name, fresh, unseen=False):
    """The op's own storages do not fit the budget: said once; raised under strict.
    ``unseen``: storages it reads that were allocated outside the dispatcher (before
    the block, or grown by ``resize_``) do not fit."""
    from vmalloc.errors import OutOfMemoryError
    self._counts["over_budget_ops"] += 1
    running = getattr(self.runtime, "running_function", None)
    what = (running() if running is not None else None) or name
    message = (f"{what} needs {fresh} bytes for its outputs besides its inputs, more than "
               f"the budget of {self.runtime.budget} bytes leaves")
    if unseen:
        message = (f"{what} uses {fresh} bytes of storages allocated outside the "
                   "dispatcher (before the block, or by resize_), more than the budget of "
                   f"{self.runtime.budget} bytes leaves")
    if self.strict:
        raise OutOfMemoryError(message + ": refused (strict=True); the op did not run",
                               requested_bytes=fresh)
    self._say("over_budget", message + ": it runs over the budget")
