"""Schedules: what a scheduler decided for each function of a sequence.

A :class:`Schedule` has one :class:`Step` per function. Around function ``i`` the actions run
in this order (the runtime and the simulator both follow it):

before the function
  1. ``wait_swap_out``: the host waits for these swap-outs to complete; their device memory is
     released (the paper's step (b): wait for the oldest swap-outs until swap-ins fit).
  2. ``allocate``: variables whose content is not needed (first written here, or rewritten
     before being read) get device memory, with no copy (nnabla: "reserved, not prefetched").
  3. ``swap_in``: swap-ins issued on the host-to-device stream (step (a): variables entering the
     window). Their device memory is taken now.
  4. ``wait_swap_in``: the compute stream waits for these swap-ins.
then the function runs on the compute stream, and after it
  5. ``free``: variables never used again this iteration (or dead until rewritten) are freed.
  6. ``swap_out``: swap-outs issued on the device-to-host stream, ordered after the function
     (step (c)). Their memory stays taken until a ``wait_swap_out`` (or ``end_wait_swap_out``).

``initial_resident`` are the persistent variables on the device when the iteration starts;
every other persistent variable starts on the host. After the last step the host waits for
``end_wait_swap_out``, and the persistent variables on the device must again be exactly
``initial_resident``, so iterations repeat. Transient variables are allocated at their first use
and are gone by the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from vmalloc.errors import VmallocError

ACTIONS_BEFORE = ("wait_swap_out", "allocate", "swap_in", "wait_swap_in")
ACTIONS_AFTER = ("free", "swap_out")


class ScheduleError(VmallocError, ValueError):
    """A schedule that breaks a rule (see :meth:`Schedule.check`), or a budget a function can
    never fit. ``function`` is the index of the function concerned (None for the whole)."""

    def __init__(self, message, function=None):
        super().__init__(message)
        self.function = function


@dataclass
class Step:
    """The actions around one function (variable ids)."""

    wait_swap_out: List[int] = field(default_factory=list)
    allocate: List[int] = field(default_factory=list)
    swap_in: List[int] = field(default_factory=list)
    wait_swap_in: List[int] = field(default_factory=list)
    free: List[int] = field(default_factory=list)
    swap_out: List[int] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.wait_swap_out or self.allocate or self.swap_in or self.wait_swap_in
                    or self.free or self.swap_out)


@dataclass
class Schedule:
    """A scheduler's plan for one iteration of a :class:`~vmalloc.offload.FunctionSequence`."""

    scheduler: str
    steps: List[Step]
    budget: Optional[int] = None
    params: Dict[str, object] = field(default_factory=dict)
    initial_resident: frozenset = frozenset()
    end_wait_swap_out: List[int] = field(default_factory=list)
    #: The most device bytes the plan holds at once by its own accounting (set by check()).
    planned_peak: Optional[int] = None

    def __len__(self):
        return len(self.steps)

    def swapped_out(self) -> List[int]:
        """Variable ids swapped out, one entry per swap-out, in order."""
        return [v for s in self.steps for v in s.swap_out]

    def swapped_in(self) -> List[int]:
        return [v for s in self.steps for v in s.swap_in]

    def swap_out_bytes(self, seq) -> int:
        return sum(seq.variables[v].nbytes for v in self.swapped_out())

    def swap_in_bytes(self, seq) -> int:
        return sum(seq.variables[v].nbytes for v in self.swapped_in())

    def describe(self, seq=None, limit: Optional[int] = None) -> str:
        """A readable listing: one line per function with something scheduled around it."""
        def names(ids):
            if seq is None:
                return ",".join(f"v{v}" for v in ids)
            return ",".join(seq.variables[v].name for v in ids)

        head = f"schedule: {self.scheduler}"
        if self.params:
            head += " (" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"
        if self.budget is not None:
            from vmalloc.sizes import format_size
            head += f", budget {format_size(self.budget)}"
        lines = [head]
        shown = 0
        for i, step in enumerate(self.steps):
            if step.empty():
                continue
            if limit is not None and shown >= limit:
                lines.append("...")
                break
            shown += 1
            fname = seq.functions[i].name if seq is not None else f"f{i}"
            parts = [f"{a}[{names(getattr(step, a))}]"
                     for a in ACTIONS_BEFORE if getattr(step, a)]
            parts.append(f"<{fname}>")
            parts += [f"{a}[{names(getattr(step, a))}]"
                      for a in ACTIONS_AFTER if getattr(step, a)]
            lines.append(f"{i:6d}: " + " ".join(parts))
        if self.end_wait_swap_out:
            lines.append(f"   end: wait_swap_out[{names(self.end_wait_swap_out)}]")
        return "\n".join(lines)

    def __str__(self):
        return self.describe()
