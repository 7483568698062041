"""Schedules: what a scheduler decided for each function of a sequence.

A :class:`Schedule` has one :class:`Step` per function. Around function ``i`` the actions run
in this order (the runtime and the simulator both follow it):

before the function
  0. ``drop``: variables whose host copy is still valid (it came back by a swap-in, or went out
     by a swap-out, and nothing wrote it since) release their device memory with **no copy**:
     swapping them out again would move bytes the host already holds. They are on_host after.
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

``end_drop`` are dropped after ``end_wait_swap_out``'s waits (a persistent variable whose host
copy is valid going back to the host for the next iteration).

``initial_resident`` are the persistent variables on the device when the iteration starts;
every other persistent variable starts on the host. After the last step the host waits for
``end_wait_swap_out``, and the persistent variables on the device must again be exactly
``initial_resident``, so iterations repeat. Transient variables are allocated at their first use
and are gone by the end.

Variable states, as :meth:`Schedule.check` replays them: *absent* (a transient variable not yet
born or freed; a freed persistent one), *on_host*, *swapping_in* (memory taken, copy in flight),
*resident*, *swapping_out* (memory taken until the swap-out is waited). Device bytes in use are
resident + swapping in + swapping out + allocated. A function may read only a resident variable
with content (swap-in waited, or written since allocation; a transient variable allocated at its
first use, when that use is a read, holds data from outside, e.g. the input batch), and may write
only a resident variable.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Dict, List, Optional

from vmalloc.errors import VmallocError

ACTIONS_BEFORE = ("drop", "wait_swap_out", "allocate", "swap_in", "wait_swap_in")
ACTIONS_AFTER = ("free", "swap_out")


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector paused, then restored as it was. Schedulers build hundreds
    of thousands of lists and no cycles; with the collector on, each generation-2 pass walks
    every object alive (the sequence's functions and variables too): about half of a 10^5-
    function window schedule's time."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class ScheduleError(VmallocError, ValueError):
    """A schedule that breaks a rule (see :meth:`Schedule.check`), or a budget a function can
    never fit. ``function`` is the index of the function concerned (None for the whole);
    ``needed_bytes`` what it needs at once, where the scheduler says (else None)."""

    def __init__(self, message, function=None, needed_bytes=None):
        super().__init__(message)
        self.function = function
        self.needed_bytes = needed_bytes


# __slots__ (cheaper to build 10^5 of them) where dataclasses can make them: Python >= 3.10
@dataclass(**({"slots": True} if sys.version_info >= (3, 10) else {}))
class Step:
    """The actions around one function (variable ids)."""

    wait_swap_out: List[int] = field(default_factory=list)
    allocate: List[int] = field(default_factory=list)
    swap_in: List[int] = field(default_factory=list)
    wait_swap_in: List[int] = field(default_factory=list)
    free: List[int] = field(default_factory=list)
    swap_out: List[int] = field(default_factory=list)
    drop: List[int] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.wait_swap_out or self.allocate or self.swap_in or self.wait_swap_in
                    or self.free or self.swap_out or self.drop)


def empty_steps(n) -> List[Step]:
    """``[Step() for _ in range(n)]``, five times cheaper: the dataclass's ``__init__`` (a
    Python frame and seven ``default_factory`` calls per step) was a tenth of a window
    schedule."""
    new = object.__new__
    steps = [new(Step) for _ in range(n)]
    for s in steps:
        s.wait_swap_out = []
        s.allocate = []
        s.swap_in = []
        s.wait_swap_in = []
        s.free = []
        s.swap_out = []
        s.drop = []
    return steps


@dataclass
class Schedule:
    """A scheduler's plan for one iteration of a :class:`~vmalloc.offload.FunctionSequence`."""

    scheduler: str
    steps: List[Step]
    budget: Optional[int] = None
    params: Dict[str, object] = field(default_factory=dict)
    initial_resident: frozenset = frozenset()
    end_wait_swap_out: List[int] = field(default_factory=list)
    end_drop: List[int] = field(default_factory=list)
    #: Recompute (:class:`~vmalloc.offload.scheduling.recompute.Recompute`): the steps are those of its
    #: expanded ``sequence``, in which inserted functions re-run recorded ones (None: none).
    recompute: Optional[object] = None
    #: Variables (ids of the sequence scheduled) swapped in a compressed format, and which
    #: (``"fp16"`` or ``"bf16"``: half the bytes on the link, a cast on the copy stream).
    compressed: frozenset = frozenset()
    compression: Optional[str] = None
    #: The most device bytes the plan holds at once by its own accounting (set by check()).
    planned_peak: Optional[int] = None

    def __len__(self):
        return len(self.steps)

    def check(self, seq, budget: Optional[int] = None) -> int:
        """Replays the plan over variable states; raises :class:`ScheduleError` (with
        ``function`` set to the index concerned, or None for the end of the iteration) at the
        first violation; returns the planned peak device bytes and stores it in
        ``planned_peak``.

        The rules: a function reads only a resident variable whose swap-in was waited and whose
        content exists, and writes only a resident variable; ``swap_in`` needs an on_host
        variable, ``swap_out`` a resident one, ``wait_swap_in``/``wait_swap_out`` a transfer in
        flight, ``allocate`` a variable holding no memory, ``free`` a resident one; at the end
        no transient variable is alive, no swap-out is in flight and every persistent variable is
        where it started (a persistent variable whose first use is write-only and that started
        on the host may also end absent: its content is dead); device bytes (measured after each
        step's allocate and swap_in) never exceed ``budget``; and no transfer is redundant: a
        swap-in must be read by a function before its variable is swapped out, freed or
        overwritten, and a swap-out's variable must next be used by a read (this iteration, or,
        for a persistent variable, wrapping to the next) -- a transient variable never used again
        is freed, not swapped out, and content about to be overwritten is freed.

        No waste: ``drop`` needs a resident variable whose host copy is valid (swapped in or out
        and not written since), and a swap-out of such a variable is refused as a *recopy*
        ("drop it instead") -- unless the schedule's ``params["drop"]`` is False, which a
        scheduler sets when it was asked not to drop (for a runtime that cannot yet).
        """
        return _check(self, seq, budget)

    def dropped(self) -> List[int]:
        """Variable ids dropped (released with no copy), one entry per drop, in order."""
        return [v for s in self.steps for v in s.drop] + list(self.end_drop)

    def sequence_of(self, seq):
        """The sequence the steps are for: ``seq``, or the expanded one under recompute."""
        return self.recompute.sequence if self.recompute is not None else seq

    def moved_bytes(self, seq, v) -> int:
        """Bytes one swap of variable ``v`` puts on the link (halved when compressed)."""
        n = self.sequence_of(seq).variables[v].nbytes
        return n // 2 if v in self.compressed else n

    def recomputed_functions(self) -> int:
        """Functions the iteration re-runs."""
        return 0 if self.recompute is None else len(self.recompute.origin)

    def swapped_out(self) -> List[int]:
        """Variable ids swapped out, one entry per swap-out, in order."""
        return [v for s in self.steps for v in s.swap_out]

    def swapped_in(self) -> List[int]:
        return [v for s in self.steps for v in s.swap_in]

    def swap_out_bytes(self, seq) -> int:
        """Bytes the swap-outs put on the link (compressed ones at their compressed size)."""
        return self._moved(seq, self.swapped_out())

    def swap_in_bytes(self, seq) -> int:
        return self._moved(seq, self.swapped_in())

    def moved_bytes_total(self, seq) -> int:
        """``swap_out_bytes(seq) + swap_in_bytes(seq)`` in one pass over the steps."""
        ids = chain.from_iterable(chain.from_iterable(
            map(attrgetter("swap_out", "swap_in"), self.steps)))
        return self._moved(seq, ids)

    def _moved(self, seq, ids) -> int:
        """sum(moved_bytes(seq, v) for v in ids), without a call per variable."""
        variables = self.sequence_of(seq).variables
        comp = self.compressed
        if not comp:
            return sum([variables[v].nbytes for v in ids])
        return sum([variables[v].nbytes // 2 if v in comp else variables[v].nbytes
                    for v in ids])

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
        if self.end_drop:
            lines.append(f"   end: drop[{names(self.end_drop)}]")
        return "\n".join(lines)

    def __str__(self):
        return self.describe()


# variable states while checking
_ABSENT, _ON_HOST, _SWAPPING_IN, _RESIDENT, _SWAPPING_OUT = range(5)
_STATE_NAMES = ("absent", "on_host", "swapping_in", "resident", "swapping_out")


def _check(sched, seq, budget):
    if sched.recompute is not None:
        from vmalloc.offload.scheduling.recompute import check_recompute

        seq = check_recompute(sched, seq)
    nvar = len(seq.variables)
    nfun = len(seq.functions)
    variables = seq.variables
    if len(sched.steps) != nfun:
        raise ScheduleError(f"the schedule has {len(sched.steps)} steps for {nfun} functions")
    sizes = [v.nbytes for v in variables]
    persistent = [v.persistent for v in variables]
    uses = seq.uses()
    # reads_at[v][k]: whether the k-th use of v reads it
    reads_at = [[] for _ in range(nvar)]
    for f in seq.functions:
        ins = set(f.inputs)
        for v in f.uses:
            reads_at[v].append(v in ins)
    pos = [0] * nvar            # index into uses[v] of v's next use

    def name(v):
        return f"{variables[v].name} (v{v})"

    def fname(i):
        return f"function {i} ({seq.functions[i].name})"

    def fail(i, msg):
        where = fname(i) if i is not None else "end of iteration"
        raise ScheduleError(f"{where}: {msg}", function=i)

    for v in sched.initial_resident:
        if not (isinstance(v, int) and 0 <= v < nvar) or not persistent[v]:
            raise ScheduleError(f"initial_resident: {v!r} is not a persistent variable")
    state = [_ABSENT] * nvar
    content = [False] * nvar    # resident memory holds the variable's data
    born = [False] * nvar       # transient variable allocated at least once
    unread_swap_in = [False] * nvar
    host_valid = [False] * nvar     # the host holds the variable's current content
    recopy_ok = sched.params.get("drop", True) is False
    live = 0
    for v in range(nvar):
        if persistent[v]:
            if v in sched.initial_resident:
                state[v] = _RESIDENT
                content[v] = True
                live += sizes[v]
            else:
                state[v] = _ON_HOST
                host_valid[v] = True
    peak = live
    if budget is not None and live > budget:
        raise ScheduleError(f"initial resident variables take {live} bytes; the budget is "
                            f"{budget}", function=0 if nfun else None)

    def valid(i, what, ids):
        for v in ids:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < nvar:
                fail(i, f"{what}: {v!r} is not a variable id")

    def next_use(v, i):
        """(function index, reads) of v's next use after function i; wraps for persistent
        variables; (None, None) if there is none."""
        u = uses[v]
        k = pos[v]
        while k < len(u) and u[k] <= i:
            k += 1
        if k < len(u):
            return u[k], reads_at[v][k]
        if persistent[v] and u:
            return u[0], reads_at[v][0]
        return None, None

    def wait_out(i, v):
        nonlocal live
        if state[v] != _SWAPPING_OUT:
            fail(i, f"wait_swap_out of {name(v)}, which is {_STATE_NAMES[state[v]]}, "
                    "not swapping out")
        state[v] = _ON_HOST
        content[v] = False
        live -= sizes[v]

    def drop(i, v):
        nonlocal live
        if state[v] != _RESIDENT:
            fail(i, f"drop of {name(v)}, which is {_STATE_NAMES[state[v]]}, not resident")
        if unread_swap_in[v]:
            fail(i, f"redundant swap-in: {name(v)} is dropped without being read since its "
                    "swap-in")
        if not content[v] or not host_valid[v]:
            fail(i, f"drop of {name(v)}, whose host copy is not valid (written since it was "
                    "last copied): it must be swapped out")
        state[v] = _ON_HOST
        content[v] = False
        live -= sizes[v]

    for i, step in enumerate(sched.steps):
        f = seq.functions[i]
        # 0. drop
        valid(i, "drop", step.drop)
        for v in step.drop:
            drop(i, v)
        # 1. wait_swap_out
        valid(i, "wait_swap_out", step.wait_swap_out)
        for v in step.wait_swap_out:
            wait_out(i, v)
        # 2. allocate
        valid(i, "allocate", step.allocate)
        for v in step.allocate:
            st = state[v]
            if st not in (_ABSENT, _ON_HOST):
                fail(i, f"allocate of {name(v)}, which already holds memory "
                        f"({_STATE_NAMES[st]})")
            # a transient variable born here holds outside data (e.g. the input batch)
            content[v] = not persistent[v] and not born[v]
            host_valid[v] = False
            born[v] = True
            state[v] = _RESIDENT
            live += sizes[v]
        # 3. swap_in
        valid(i, "swap_in", step.swap_in)
        for v in step.swap_in:
            if state[v] != _ON_HOST:
                fail(i, f"swap_in of {name(v)}, which is {_STATE_NAMES[state[v]]}, not on_host")
            state[v] = _SWAPPING_IN
            content[v] = True
            unread_swap_in[v] = True
            live += sizes[v]
        if live > peak:
            peak = live
        if budget is not None and live > budget:
            fail(i, f"device bytes reach {live} after allocate and swap_in; the budget is "
                    f"{budget}")
        # 4. wait_swap_in
        valid(i, "wait_swap_in", step.wait_swap_in)
        for v in step.wait_swap_in:
            if state[v] != _SWAPPING_IN:
                fail(i, f"wait_swap_in of {name(v)}, which is {_STATE_NAMES[state[v]]}, "
                        "not swapping in")
            state[v] = _RESIDENT
        # the function
        ins = f.inputs
        for v in ins:
            st = state[v]
            if st != _RESIDENT:
                if st == _SWAPPING_IN:
                    fail(i, f"reads {name(v)}, whose swap-in was not waited")
                fail(i, f"reads {name(v)}, which is {_STATE_NAMES[st]}, not resident")
            if not content[v]:
                fail(i, f"reads {name(v)}, which was allocated but never written (its content "
                        "was not swapped in)")
            unread_swap_in[v] = False
        if f.outputs:
            insset = set(ins)
            for v in f.outputs:
                st = state[v]
                if st != _RESIDENT:
                    if st in (_SWAPPING_IN, _SWAPPING_OUT):
                        fail(i, f"writes {name(v)} while its {_STATE_NAMES[st].replace('_', '-')}"
                                " is in flight")
                    fail(i, f"writes {name(v)}, which has no memory ({_STATE_NAMES[st]})")
                if v not in insset and unread_swap_in[v]:
                    fail(i, f"redundant swap-in: {name(v)} was swapped in but this function "
                            "overwrites it without reading it")
                content[v] = True
                host_valid[v] = False
        for v in f.uses:
            u = uses[v]
            k = pos[v]
            while k < len(u) and u[k] <= i:
                k += 1
            pos[v] = k
        # 5. free
        valid(i, "free", step.free)
        for v in step.free:
            if state[v] != _RESIDENT:
                fail(i, f"free of {name(v)}, which is {_STATE_NAMES[state[v]]}, not resident")
            if unread_swap_in[v]:
                fail(i, f"redundant swap-in: {name(v)} is freed without being read since its "
                        "swap-in")
            state[v] = _ABSENT
            content[v] = False
            host_valid[v] = False
            live -= sizes[v]
        # 6. swap_out
        valid(i, "swap_out", step.swap_out)
        for v in step.swap_out:
            if state[v] != _RESIDENT:
                fail(i, f"swap_out of {name(v)}, which is {_STATE_NAMES[state[v]]}, "
                        "not resident")
            if unread_swap_in[v]:
                fail(i, f"redundant swap-in: {name(v)} is swapped out without being read since "
                        "its swap-in")
            if not content[v]:
                fail(i, f"redundant swap-out: {name(v)} holds no content")
            j, reads = next_use(v, i)
            if j is None:
                fail(i, f"redundant swap-out: {name(v)} is never used again (free it instead)")
            if not reads:
                fail(i, f"redundant swap-out: the next use of {name(v)} (function {j}) "
                        "overwrites it without reading (free it instead)")
            if host_valid[v] and not recopy_ok:
                fail(i, f"recopy: {name(v)} is swapped out although its host copy is still "
                        "valid (nothing wrote it since it was last copied): drop it instead")
            host_valid[v] = True
            state[v] = _SWAPPING_OUT
    valid(None, "end_wait_swap_out", sched.end_wait_swap_out)
    for v in sched.end_wait_swap_out:
        wait_out(None, v)
    valid(None, "end_drop", sched.end_drop)
    for v in sched.end_drop:
        drop(None, v)
    initial = sched.initial_resident
    for v in range(nvar):
        st = state[v]
        if st == _SWAPPING_OUT:
            fail(None, f"the swap-out of {name(v)} is still in flight (wait for it in "
                       "end_wait_swap_out)")
        if st == _SWAPPING_IN:
            fail(None, f"the swap-in of {name(v)} is still in flight")
        if persistent[v]:
            want = _RESIDENT if v in initial else _ON_HOST
            if st != want:
                u = uses[v]
                dead = u and not reads_at[v][0]
                if not (want == _ON_HOST and st == _ABSENT and dead):
                    fail(None, f"persistent {name(v)} ends {_STATE_NAMES[st]}; it started "
                               f"{_STATE_NAMES[want]}")
        elif st != _ABSENT:
            fail(None, f"transient {name(v)} is still alive ({_STATE_NAMES[st]})")
    sched.planned_peak = peak
    return peak

