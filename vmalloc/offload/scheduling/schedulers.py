"""Schedulers by name: ``make_scheduler("window", window="4GiB", budget="12GiB")``."""

from __future__ import annotations

from vmalloc.errors import InvalidArgumentError

#: Scheduler names :func:`make_scheduler` accepts ("none" is the in-core baseline).
SCHEDULERS = ("window", "lms", "vdnn", "none")


def make_scheduler(name: str, **params):
    """Returns the scheduler called ``name`` (one of :data:`SCHEDULERS`) built with ``params``:
    ``window``: window, budget, persistent; ``lms``: swapout_threshold, swapin_ahead;
    ``vdnn``: forward_end; ``none``: nothing."""
    if name == "window":
        from vmalloc.offload.scheduling.window import WindowScheduler as cls
    elif name == "lms":
        from vmalloc.offload.scheduling.lms import LMSScheduler as cls
    elif name == "vdnn":
        from vmalloc.offload.scheduling.vdnn import VDNNScheduler as cls
    elif name == "none":
        from vmalloc.offload.scheduling.in_core import InCoreScheduler as cls
    else:
        raise InvalidArgumentError(
            f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise InvalidArgumentError(f"scheduler {name!r}: {e}") from None
