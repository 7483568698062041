"""The in-core baseline: nothing is swapped.

Every persistent variable is resident throughout (``initial_resident``); each transient one is
allocated before its first use and freed after its last. Its planned peak is
:meth:`FunctionSequence.in_core_peak`.
"""

from __future__ import annotations

from vmalloc.offload.scheduling.schedule import Schedule, Step


def in_core_steps(seq):
    """The in-core plan that LMS and vDNN add their swaps to: ``(steps, resident)`` with every
    persistent variable resident and each transient one allocated before its first use and
    freed after its last."""
    steps = [Step() for _ in seq.functions]
    uses = seq.uses()
    resident = []
    for v in seq.variables:
        u = uses[v.id]
        if v.persistent:
            resident.append(v.id)
        elif u:
            steps[u[0]].allocate.append(v.id)
            steps[u[-1]].free.append(v.id)
    return steps, resident


class InCoreScheduler:
    """No swaps: the schedule a GPU with enough memory would run."""

    name = "none"

    def __init__(self):
        pass

    def schedule(self, seq) -> Schedule:
        steps, resident = in_core_steps(seq)
        return Schedule("none", steps, params={}, initial_resident=frozenset(resident))

    __call__ = schedule

    def __repr__(self):
        return "InCoreScheduler()"
