"""The paper's window-based swap scheduler (Hayakawa & Narihira, section 3).

Two limits drive it:

- the **window** (bytes): before function ``i`` the window holds functions ``i, i+1, ...``,
  counted until the distinct variables they use would exceed ``window`` bytes (always at least
  function ``i``). The window says *how far ahead* to prefetch.
- the **budget** (bytes): device bytes the plan may hold at once -- resident variables,
  swap-ins in flight, swap-outs not yet waited, and reservations. The budget says *how much*.

Before function ``i``:

(a) functions newly entering the window are admitted in order; each variable of an admitted
    function that is on the host and read there gets a ``swap_in`` issued now (and a
    ``wait_swap_in`` before that function). A fresh or write-only variable is not prefetched
    but **reserved**: it counts in the window from admission, and against the budget only from
    its own function, where it is ``allocate``-d (nnabla's ``reserve_unprefetched_memory``:
    "reserved, not prefetched"); before that function the oldest swap-outs are waited for
    until it fits. So is a transient variable whose first use is a read (its data comes from
    outside, e.g. the input batch).
(b) if an admission's swap-ins do not fit the budget, the oldest swap-outs in flight are
    waited for (``wait_swap_out``, FIFO) until they fit. A later function is admitted only if
    its swap-ins, its reservations and every reservation still to come fit the budget once
    every swap-out in flight is waited for (so a reservation always fits at its function;
    nnabla instead over-commits and re-plans with prefetches cancelled). Otherwise the window
    stops advancing (prefetch less) and admission resumes at a later function. If function
    ``i`` itself cannot fit even with every swap-out waited, :class:`ScheduleError` is raised.

After function ``i``:

(c) each variable it used whose next use lies beyond the window head is swapped out,
(d) except variables never used again (transient: ``free``; persistent with ``persistent="swap"``:
    swapped out so the host holds it for the next iteration, or freed when the next iteration
    first overwrites it) and variables whose next use is write-only (``free``: content dead).

**Cancel.** nnabla cancels a pending swap-out when its array re-enters the window before the
copy was waited. The schedule is built offline, so the cancel takes its offline form: the
swap-out is removed from the step where it was issued; the device-to-host copy never happens and
the variable simply stays resident.

``persistent="swap"`` (the paper): parameters and optimizer state are scheduled like
everything else; they start on the host, are swapped out after their last use and every
swap-out left is waited at the end (``end_wait_swap_out``). ``persistent="resident"``:
persistent variables stay on the device (``initial_resident``) and count in the budget; the
window counts only the variables it schedules.

The main loop runs compiled (``_window_loop.pyx``); the Python loop below is its reference
(tests compare the two) and the one that records ``trace=``.
"""

from __future__ import annotations

from collections import deque
from itertools import chain

import numpy as np

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.scheduling._window_loop import uses_and_next, window_loop
from vmalloc.offload.scheduling.schedule import (Schedule, ScheduleError, Step, empty_steps,
                                                 paused_gc)
from vmalloc.sizes import format_size, parse_size

_ABSENT, _ON_HOST, _HELD, _SWAPPING_OUT, _DROPPING = range(5)
#: byte totals at or above this take the Python loop (the compiled one sums in int64)
_LIMIT = 1 << 62


def _settle(v, sizes, out_token, state, step, i, trace):
    """v's swap-out in flight is taken before function i (``step.drop``: a pending drop, its
    memory released; else ``step.wait_swap_out``, the copy waited for): v is on the host.
    Returns its bytes, which leave ``held`` and the bytes in flight (``_window_loop.settle``)."""
    out_token[v] = 0
    if state[v] == _DROPPING:
        step.drop.append(v)
        if trace is not None:
            trace.append(("drop", i, v))
    else:
        step.wait_swap_out.append(v)
        if trace is not None:
            trace.append(("wait", i, v))
    state[v] = _ON_HOST
    return sizes[v]


def _uses_and_next(functions, nvar, managed):
    """Per function: the managed variables it uses, each once, its reads first (``var``, all
    functions' one after the other, function i's at ``bounds[i]:bounds[i+1]``), how many of
    them it reads (``reads``: the reads are a prefix), and for each its next use, encoded in one
    int (``nxt``): ``j >= 0`` a read at function j, ``-2 - j`` a write-only use at j (its
    content is dead), ``-1`` none this iteration; and per variable whether its first use reads
    it (``first_reads``). NumPy arrays. Vectorised: one Python pass per function costs a third
    of a schedule."""
    n = len(functions)
    ins = [f.inputs for f in functions]
    outs = [f.outputs for f in functions]
    nin = np.array(list(map(len, ins)), np.int64)
    nout = np.array(list(map(len, outs)), np.int64)
    flat = list(chain.from_iterable(ins))
    m_in = len(flat)
    flat.extend(chain.from_iterable(outs))
    var = np.array(flat, np.int64)
    m_out = len(flat) - m_in
    idx = np.arange(n, dtype=np.int64)
    fun = np.concatenate((np.repeat(idx, nin), np.repeat(idx, nout)))
    written = np.zeros(m_in + m_out, bool)
    written[m_in:] = True
    # per function its inputs, then its outputs, each in its recorded order (a stable sort)
    order = np.argsort(fun * 2 + written, kind="stable")
    var, fun, written = var[order], fun[order], written[order]
    if not all(managed):
        keep = np.asarray(managed, bool)[var]
        var, fun, written = var[keep], fun[keep], written[keep]
    # each variable once per function, at its first mention (a read if it is an input)
    _, first = np.unique(fun * nvar + var, return_index=True)
    first.sort()
    var, fun, written = var[first], fun[first], written[first]
    counts = np.bincount(fun, minlength=n)
    reads = np.bincount(fun[~written], minlength=n)
    # the next use of the same variable: entries grouped by variable, in function order
    byvar = np.argsort(var, kind="stable")
    code = np.where(written, -2 - fun, fun)
    nxt = np.full(len(var), -1, np.int64)
    same = var[byvar[1:]] == var[byvar[:-1]]
    nxt[byvar[:-1][same]] = code[byvar[1:][same]]
    first_reads = np.zeros(nvar, bool)
    starts = np.ones(len(var), bool)
    starts[1:] = ~same
    heads = byvar[starts]
    first_reads[var[heads]] = ~written[heads]
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=bounds[1:])
    return var, nxt, bounds, reads, first_reads


def _as_lists(var, nxt, bounds, reads, first_reads):
    """``_uses_and_next``'s arrays as the Python loop reads them: per function its list of
    variables and of next uses."""
    vs, nx = var.tolist(), nxt.tolist()
    b = bounds.tolist()
    spans = list(zip(b, b[1:]))
    return ([vs[x:y] for x, y in spans], reads.tolist(), [nx[x:y] for x, y in spans],
            first_reads.tolist())


class WindowScheduler:
    """Window-based swap scheduling (see the module docstring).

    Args:
        window: look-ahead in bytes (int or a string such as ``"4GiB"``); positive.
        budget: device bytes the plan may hold at once.
        persistent: ``"swap"`` (persistent variables start on the host and swap like the rest)
            or ``"resident"`` (they stay on the device, counted in the budget).
    """

    name = "window"

    def __init__(self, window, budget, persistent: str = "swap", drop: bool = False):
        self.window = parse_size(window, "window")
        self.budget = parse_size(budget, "budget")
        if self.window <= 0:
            raise InvalidArgumentError("window must be positive")
        if persistent not in ("swap", "resident"):
            raise InvalidArgumentError(
                f"persistent must be 'swap' or 'resident', got {persistent!r}")
        self.persistent = persistent
        self.drop = bool(drop)

    def __repr__(self):
        return (f"WindowScheduler(window={self.window}, budget={self.budget}, "
                f"persistent={self.persistent!r}, drop={self.drop!r})")

    def schedule(self, seq, trace=None) -> Schedule:
        """Returns the schedule of ``seq``. Raises :class:`ScheduleError` when a function's own
        variables (plus resident persistent ones) exceed the budget. If ``trace`` is a list,
        the decisions are appended to it as tuples: ``("window", i, hm)`` (the byte window is
        functions ``[i, hm)``), ``("admit", i, j)``, ``("stall", i, j)`` (``f_j`` did not fit:
        the window stops advancing), ``("wait", i, v)``, ``("cancel", i, v, k)`` (the swap-out
        issued after ``f_k`` is dropped)."""
        with paused_gc():
            if trace is None:
                sched = self._schedule_compiled(seq)
                if sched is not None:
                    return sched
            return self._schedule_py(seq, trace)

    def _prepare(self, seq):
        """What both loops start from: per variable its size, whether it is persistent and
        managed (scheduled here), the resident persistent variables and their bytes."""
        swap_persistent = self.persistent == "swap"
        variables = seq.variables
        sizes = [v.nbytes for v in variables]
        persistent = [v.persistent for v in variables]
        managed = [swap_persistent or not p for p in persistent]
        resident = [] if swap_persistent else [v for v in range(len(variables)) if persistent[v]]
        fixed = sum([sizes[v] for v in resident])
        if fixed > self.budget:
            raise ScheduleError(
                f"the resident persistent variables take {format_size(fixed)} ({fixed} bytes); "
                f"the budget is {format_size(self.budget)} ({self.budget} bytes)", function=None)
        return sizes, persistent, managed, resident, fixed

    def _too_big(self, seq, i, vs, sizes, fixed):
        """The error for function i, whose managed variables ``vs`` never fit the budget."""
        budget = self.budget
        total = sum(sizes[v] for v in vs) + fixed
        detail = f" ({format_size(fixed)} of it resident persistent variables)" if fixed else ""
        return ScheduleError(
            f"function {i} ({seq.functions[i].name}) needs {format_size(total)} "
            f"({total} bytes){detail}; the budget is {format_size(budget)} "
            f"({budget} bytes)", function=i, needed_bytes=total)

    def _result(self, steps, resident, end, end_drop):
        params = {"window": self.window, "persistent": self.persistent, "drop": self.drop}
        return Schedule("window", steps, budget=self.budget, params=params,
                        initial_resident=frozenset(resident), end_wait_swap_out=end,
                        end_drop=end_drop)

    def _schedule_compiled(self, seq):
        """The main loop in C (``_window_loop``): the same schedule as ``_schedule_py``. None
        when a byte total could overflow its int64 sums."""
        sizes, persistent, managed, resident, fixed = self._prepare(seq)
        if sum(sizes) >= _LIMIT:
            return None
        functions = seq.functions
        n, nvar = len(functions), len(sizes)
        pers = np.array(persistent, np.uint8)
        var, nxt, bounds, reads, first_reads, outs, out_bounds = uses_and_next(
            functions, nvar, np.array(managed, np.uint8))
        swap_persistent = self.persistent == "swap"
        state = pers * np.uint8(_ON_HOST) if swap_persistent else np.zeros(nvar, np.uint8)
        hvalid = pers.copy() if swap_persistent else np.zeros(nvar, np.uint8)
        clamp = lambda x: max(-_LIMIT, min(x, _LIMIT))   # noqa: E731 - the same comparisons
        fail, steps, end, end_drop = window_loop(
            n, nvar, np.array(sizes, np.int64), pers, var, nxt, bounds, reads,
            first_reads, outs, out_bounds, state, hvalid, fixed,
            clamp(self.budget), clamp(self.window), self.drop, Step)
        if fail >= 0:
            raise self._too_big(seq, fail, var[bounds[fail]:bounds[fail + 1]].tolist(), sizes,
                                fixed)
        return self._result(steps, resident, end, end_drop)

    def _schedule_py(self, seq, trace):
        """The main loop in Python: the reference the compiled one is tested against, and
        the one that records ``trace``."""
        budget = self.budget
        window = self.window
        swap_persistent = self.persistent == "swap"
        functions = seq.functions
        n = len(functions)
        nvar = len(seq.variables)
        sizes, persistent, managed, resident, fixed = self._prepare(seq)
        fman, fnin, fnext, first_reads = _as_lists(*_uses_and_next(functions, nvar, managed))
        steps = empty_steps(n)
        if swap_persistent:
            state = [_ON_HOST if p else _ABSENT for p in persistent]
        else:
            state = [_ABSENT] * nvar
        held = fixed

        use_drop = self.drop
        # the host holds v's current content (it came in by a swap-in or went out by a
        # swap-out, and nothing wrote it since): leaving the device needs no copy
        hvalid = list(persistent) if swap_persistent else [False] * nvar
        fifo = deque()              # (token, v, step) of swap-outs in flight, oldest first
        out_token = [0] * nvar      # token of v's swap-out in flight (0: none)
        out_step = [0] * nvar
        token = 0
        cnt = [0] * nvar            # uses of v by functions in the byte window [i, hm)
        wbytes = 0
        hm = 0                      # byte-window head (exclusive)
        head = 0                    # admitted head (exclusive): functions [i, head) are admitted
        # reservations charged to the budget only at their own function (nnabla's
        # reserve_unprefetched_memory): per function their bytes, and their total still to come
        deferred = [0] * n
        pend = 0
        fbytes = 0                  # bytes of the swap-outs and drops in flight (in ``held``)

        for i in range(n):
            step = steps[i]
            # the byte window [i, hm)
            if i:
                for v in fman[i - 1]:
                    c = cnt[v] - 1
                    cnt[v] = c
                    if not c:
                        wbytes -= sizes[v]
            while hm < n:
                vs = fman[hm]
                add = 0
                for v in vs:
                    if not cnt[v]:
                        add += sizes[v]
                if hm > i and wbytes + add > window:
                    break
                for v in vs:
                    cnt[v] += 1
                wbytes += add
                hm += 1
            if trace is not None:
                trace.append(("window", i, hm))
            d = deferred[i]
            if d:
                # function i's reservations take the budget now; the oldest swap-outs are
                # waited for until they fit (admission left room: they always do)
                pend -= d
                held += d
                while held > budget and fifo:
                    t, v, _ = fifo.popleft()
                    if out_token[v] != t:
                        continue
                    nb = _settle(v, sizes, out_token, state, step, i, trace)
                    held -= nb
                    fbytes -= nb
            # (a)/(b): admit functions entering the window
            while head < hm:
                j = head
                vs = fman[j]
                need = 0
                if j == i:
                    for v in vs:
                        if state[v] <= _ON_HOST:
                            need += sizes[v]
                else:
                    # a later function: its swap-ins take the budget now, its reservations
                    # (and swap-outs it cancels) at f_j; all must fit once every swap-out in
                    # flight is waited for, with the reservations still to come
                    k = fnin[j]
                    later = 0
                    for x, v in enumerate(vs):
                        s = state[v]
                        if x < k and s == _ON_HOST:
                            need += sizes[v]
                        elif s != _HELD:
                            later += sizes[v]
                    if held - fbytes + pend + need + later > budget:
                        if trace is not None:
                            trace.append(("stall", i, j))
                        break                    # stop advancing: prefetch less
                if held + need > budget and fifo:
                    own = set(vs)
                    skipped = []
                    while held + need > budget and fifo:
                        entry = fifo.popleft()
                        t, v, _ = entry
                        if out_token[v] != t:
                            continue            # cancelled
                        if v in own:
                            skipped.append(entry)   # about to be cancelled: do not wait
                            continue
                        nb = _settle(v, sizes, out_token, state, step, i, trace)
                        held -= nb
                        fbytes -= nb
                    fifo.extendleft(reversed(skipped))
                if held + need > budget:
                    if j == i:
                        raise self._too_big(seq, i, vs, sizes, fixed)
                    if trace is not None:
                        trace.append(("stall", i, j))
                    break                        # stop advancing: prefetch less
                if trace is not None:
                    trace.append(("admit", i, j))
                jstep = steps[j]
                k = fnin[j]
                for v in (vs if k == len(vs) else vs[:k]):     # the reads
                    s = state[v]
                    if s == _HELD:
                        continue
                    elif s == _DROPPING:
                        # a pending drop re-enters the window: it simply stays resident
                        out_token[v] = 0
                        fbytes -= sizes[v]
                        if trace is not None:
                            trace.append(("keep", i, v))
                    elif s == _SWAPPING_OUT:
                        # offline cancel: the swap-out is dropped from the step that issued it
                        steps[out_step[v]].swap_out.remove(v)
                        if trace is not None:
                            trace.append(("cancel", i, v, out_step[v]))
                        out_token[v] = 0
                        fbytes -= sizes[v]
                        hvalid[v] = False           # the copy never happens
                    elif s == _ON_HOST:
                        step.swap_in.append(v)
                        jstep.wait_swap_in.append(v)
                        held += sizes[v]
                    else:
                        # a transient variable first used by a read (outside data): reserved
                        jstep.allocate.append(v)
                        if j == i:
                            held += sizes[v]
                        else:
                            deferred[j] += sizes[v]
                            pend += sizes[v]
                    state[v] = _HELD
                if k < len(vs):
                    for v in vs[k:]:
                        # write-only at f_j: reserved now, allocated at f_j. If an earlier use
                        # in the window holds v, that use frees it (content dead) and its bytes
                        # stay counted as f_j's reservation.
                        jstep.allocate.append(v)
                        if state[v] != _HELD:
                            if j == i:
                                held += sizes[v]
                            else:
                                deferred[j] += sizes[v]
                                pend += sizes[v]
                            state[v] = _HELD
                head += 1
            # (c)/(d): after function i
            if use_drop:
                for v in functions[i].outputs:
                    hvalid[v] = False
            for v, nx in zip(fman[i], fnext[i]):
                if nx >= 0:
                    if nx < head:
                        continue                # next use (a read) inside the window: keep
                    out = True
                elif nx == -1:
                    # never used again this iteration: back to the host for the next one
                    out = persistent[v] and first_reads[v]
                else:
                    out = False                 # next use overwrites it: content dead
                if out and use_drop and hvalid[v]:
                    # no copy needed: a pending drop, taken (before a later function) only
                    # when the budget needs the bytes, else the variable stays resident
                    token += 1
                    out_token[v] = token
                    out_step[v] = i
                    fifo.append((token, v, i))
                    fbytes += sizes[v]
                    state[v] = _DROPPING
                elif out:
                    token += 1
                    out_token[v] = token
                    out_step[v] = i
                    fifo.append((token, v, i))
                    fbytes += sizes[v]
                    state[v] = _SWAPPING_OUT
                    step.swap_out.append(v)
                    hvalid[v] = True
                else:
                    step.free.append(v)
                    if nx < -1 and -2 - nx < head:
                        state[v] = _HELD        # the bytes stay reserved for its next use
                    else:
                        state[v] = _ABSENT
                        held -= sizes[v]
        live = [v for t, v, _ in fifo if out_token[v] == t]
        end = [v for v in live if state[v] == _SWAPPING_OUT]
        end_drop = [v for v in live if state[v] == _DROPPING]
        return self._result(steps, resident, end, end_drop)

    __call__ = schedule
