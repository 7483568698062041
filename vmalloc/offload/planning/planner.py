"""Pick a scheduler's parameters, and the largest batch, by simulation.

:func:`plan` searches a scheduler's parameters continuously, simulating each candidate with
:func:`~vmalloc.offload.simulate` (a real allocator, so a plan that fragments the caching
allocator out of memory is rejected), and keeps the fastest that does not run out of memory:

- ``window``: a 3 x 3 seed grid (budget 0.6 / 0.75 / 0.9 of the GPU's memory, or the ``budget``
  given, times windows 256 MiB / 1 GiB / 4 GiB), then golden-section search on the budget
  (``BUDGET_RANGE``, to ``BUDGET_TOL`` of the memory), on log2 of the window (``WINDOW_RANGE``,
  to ``WINDOW_TOL``), and on the budget again. Speed rises with the budget up to the point
  where the plan runs out of memory and drops to nothing: golden section handles that cliff;
  below the budget the largest function needs there is a second one, and ties between two
  infeasible probes go toward the best point found so far (:func:`golden_max`).
  Plans drop what the host already holds (``drop=True``).
- ``lms``: ``swapout_threshold`` in 2, 8, 32, 128 times ``swapin_ahead`` in 1, 4, 16, then the
  same golden-section refinement of each integer on a log scale: the baseline searched as
  finely as the window.
- ``vdnn`` and ``none``: nothing to tune (one simulation).

``recompute=True`` repeats the search without recompute, with memory-bound recompute and with
convolutions too, and keeps the fastest (:func:`schedule_with_choices`); ``compress="fp16"``
swaps float32 activations at half their bytes (lossy, opt-in).

:func:`max_batch` is AccUDNN's tuner done by simulation: the largest batch that plans without
running out of memory at no less than ``min_relative_speed`` of the in-core speed (doubling,
then bisection).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.hardware.gpus import get_gpu
from vmalloc.offload.scheduling.schedule import ScheduleError, paused_gc
from vmalloc.offload.scheduling.schedulers import SCHEDULERS, make_scheduler
from vmalloc.offload.simulation.simulator import simulate
from vmalloc.sizes import parse_size

__all__ = ["plan", "Plan", "max_batch", "BUDGET_FRACTIONS", "WINDOWS", "in_core_reference",
           "schedule_with_choices", "golden_max"]

MiB = 1 << 20
GiB = 1 << 30
BUDGET_FRACTIONS = (0.6, 0.75, 0.9)
WINDOWS = (256 * MiB, 1 * GiB, 4 * GiB)
LMS_GRID = [(t, a) for t in (2, 8, 32, 128) for a in (1, 4, 16)]
#: The continuous search's ranges and tolerances: budget as a fraction of the GPU's memory,
#: window in bytes (searched on log2), LMS's integers on log2.
BUDGET_RANGE = (0.5, 0.995)
BUDGET_TOL = 0.005
WINDOW_RANGE = (64 * MiB, 16 * GiB)
WINDOW_TOL = 0.1
LMS_TOL = 0.15


@dataclass
class Plan:
    """The parameters :func:`plan` chose and the simulation of them. ``result`` is the best
    feasible simulation, or the last attempt (out of memory) when none was feasible."""

    scheduler: str
    params: dict
    feasible: bool
    result: object
    schedule: object = field(default=None, repr=False)
    tried: int = 0
    reason: Optional[str] = None

    def to_dict(self) -> dict:
        return {"scheduler": self.scheduler, "params": self.params, "feasible": self.feasible,
                "tried": self.tried, "reason": self.reason,
                "result": None if self.result is None else self.result.to_dict()}


def schedule_with_choices(seq, name, params, gpu="v100-16gb", recompute=None, compress=None):
    """The schedule of ``seq`` by scheduler ``name`` with ``params``, with recompute and
    compression as choices: ``recompute`` is None, ``"memory"`` (memory-bound chains only) or
    ``"all"`` (convolutions and matmuls too, when cheaper than moving the variable);
    ``compress`` None, ``"fp16"`` or ``"bf16"``. A recompute plan is kept only when it moves no
    more bytes than the swap-only schedule with the same parameters (and fits its budget);
    else the swap-only schedule is returned. Raises :class:`ScheduleError` when even that
    cannot be scheduled."""
    with paused_gc():
        return _schedule_with_choices(seq, name, params, gpu, recompute, compress)


def _schedule_with_choices(seq, name, params, gpu, recompute, compress):
    base = make_scheduler(name, **params).schedule(seq)
    sched = base
    if recompute:
        from vmalloc.offload.scheduling.recompute import recompute_candidates, with_recompute

        vs = recompute_candidates(seq, gpu, compute_bound=(recompute == "all"))
        if vs:
            rc = with_recompute(seq, vs)
            try:
                alt = make_scheduler(name, **params).schedule(rc.sequence)
            except ScheduleError:
                alt = None
            if alt is not None:
                alt.recompute = rc
                if alt.moved_bytes_total(seq) <= base.moved_bytes_total(seq):
                    sched = alt
    if compress:
        from vmalloc.offload.scheduling.recompute import COMPRESSIONS, compressible

        if compress not in COMPRESSIONS:
            raise InvalidArgumentError(f"unknown compression {compress!r}; choose from "
                                       f"{', '.join(COMPRESSIONS)}")
        sched.compressed = frozenset(compressible(sched.sequence_of(seq)))
        sched.compression = compress
    return sched


def _try(seq, name, params, gpu, allocator, chunk_size, reference=None, recompute=None,
         compress=None, sims=None):
    try:
        sched = schedule_with_choices(seq, name, params, gpu, recompute, compress)
    except ScheduleError as e:
        return None, None, str(e)
    # Nearby parameters often give the very same steps (a tenth of a table's simulations):
    # ``sims`` (one plan's) maps a schedule's content to its simulation, which depends on
    # nothing else but the schedule's params and budget, copied into the result.
    key = None if sims is None else _content(sched, recompute)
    if key is not None and key in sims:
        r = copy.deepcopy(sims[key])
        r.params = dict(sched.params)
        r.budget_bytes = sched.budget if sched.budget is not None else r.capacity_bytes
    else:
        r = simulate(seq, sched, gpu=gpu, allocator=allocator, chunk_size=chunk_size,
                     reference=reference)
        if key is not None:
            sims[key] = r
    return sched, r, (r.oom_message if r.out_of_memory else None)


def _content(sched, recompute):
    """What a simulation of ``sched`` depends on, as a dict key; the recompute variant stands
    for the expanded sequence (one per variant: its candidates depend on nothing else)."""
    return (sched.scheduler, recompute if sched.recompute is not None else None,
            sched.initial_resident, tuple(sched.end_wait_swap_out), tuple(sched.end_drop),
            sched.compressed,
            tuple((tuple(s.wait_swap_out), tuple(s.allocate), tuple(s.swap_in),
                   tuple(s.wait_swap_in), tuple(s.free), tuple(s.swap_out), tuple(s.drop))
                  for s in sched.steps))


GOLDEN = (math.sqrt(5) - 1) / 2


def golden_max(f, lo, hi, tol, integer=False, start=None):
    """Golden-section search of ``f`` over ``[lo, hi]`` for its maximum, to within ``tol``
    (integers when ``integer``). ``f`` returns None where the plan is infeasible, and that
    happens at both ends of a planner's range: below the budget the largest function needs
    and past the budget where the allocator runs out of memory. Between, f is taken unimodal.
    When the two probes tie (both infeasible, or a plateau) the comparison says nothing, so the
    search keeps the side holding the best point seen so far (``start``, a point ``(x, f(x))``
    known before the search, e.g. the seed grid's best): taking the lower side on a tie would
    walk away from a feasible region lying above both probes. Returns the best point probed
    (``start``'s x when nothing probed is better)."""
    best = [None, -1.0]
    if start is not None and start[1] is not None:
        best[0], best[1] = start[0], start[1]

    def g(x):
        if integer:
            x = int(round(x))
        y = f(x)
        y = -1.0 if y is None else y
        if y > best[1]:
            best[0], best[1] = x, y
        return y

    a, b = float(lo), float(hi)
    c = b - GOLDEN * (b - a)
    d = a + GOLDEN * (b - a)
    fc, fd = g(c), g(d)
    while b - a > tol:
        if fc == fd and best[0] is not None and best[0] > d:
            left = False            # a tie: keep the side of the best point
        elif fc == fd and best[0] is not None and best[0] < c:
            left = True
        else:
            left = fc >= fd
        if left:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = g(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = g(d)
    return best[0]


def plan(seq, gpu="v100-16gb", scheduler="window", allocator="virtual", budget=None,
         window=None, chunk_size=None, reference=None, drop=True, recompute=False,
         compress=None) -> Plan:
    """The fastest parameters of ``scheduler`` for ``seq`` on ``gpu`` with ``allocator`` that
    do not run out of memory (see the module docstring for the search). ``budget`` and
    ``window`` (window scheduler) fix those parameters instead of searching them.
    ``reference`` (``(batch, images/s)`` of the in-core limit) is passed to
    :func:`~vmalloc.offload.simulate` so that the result's ``relative_speed`` is the paper's.
    ``drop`` (window scheduler): a variable whose host copy is still valid is dropped, not
    swapped out again. ``recompute`` (True, or ``"memory"``/``"all"``): recompute considered per
    variable (:mod:`~vmalloc.offload.scheduling.recompute`): the search runs without it, with memory-bound
    chains, and with convolutions too (True), and keeps the fastest. ``compress`` (``"fp16"`` or
    ``"bf16"``, opt-in): float32 activations swapped at half their bytes."""
    gpu = get_gpu(gpu)
    if scheduler not in SCHEDULERS:
        raise InvalidArgumentError(
            f"unknown scheduler {scheduler!r}; choose from {', '.join(SCHEDULERS)}")
    best = [None]           # (ips, params, sched, result)
    last = [None, None]     # (result, reason) of the last failure
    tried = [0]
    extra = {"drop": bool(drop)} if scheduler in ("window", "lms") else {}

    variant = [None]

    def evaluate(params):
        key = (variant[0],) + tuple(sorted(params.items()))
        if key in seen:
            return seen[key]
        tried[0] += 1
        sched, r, why = _try(seq, scheduler, {**params, **extra}, gpu, allocator, chunk_size,
                             reference, variant[0], compress, sims)
        ips = None
        if r is not None and not r.out_of_memory:
            ips = r.images_per_second or 0.0
            if best[0] is None or ips > best[0][0]:
                chosen = dict(params)
                if sched.recompute is not None:
                    chosen["recompute"] = variant[0]
                best[0] = (ips, chosen, sched, r)
        else:
            last[0], last[1] = r, why
        seen[key] = ips
        return ips

    seen = {}
    sims = {}
    if recompute is True:
        variants = [None, "memory", "all"]
    elif recompute:
        variants = [None, recompute]
    else:
        variants = [None]
    if scheduler in ("none", "vdnn"):
        variants = variants[:1] if scheduler == "none" else variants
    for var_ in variants:
        variant[0] = var_
        if scheduler == "window":
            mem = gpu.memory_bytes
            if budget is not None:
                budgets = [parse_size(budget, "budget")]
            else:
                budgets = [int(f * mem) for f in BUDGET_FRACTIONS]
            windows = [parse_size(window, "window")] if window is not None else list(WINDOWS)
            for b in budgets:
                for w in windows:
                    evaluate({"window": w, "budget": b})
            if best[0] is None and budget is None:
                # nothing fits the grid's budgets: a large function may still fit nearly the
                # whole device
                for w in windows:
                    evaluate({"window": w, "budget": int(BUDGET_RANGE[1] * mem)})
            if best[0] is not None:
                # continuous refinement, one coordinate at a time: the budget (fraction of the
                # memory, to BUDGET_TOL) and the window (log2 bytes, to WINDOW_TOL)
                def by_budget(frac):
                    return evaluate({"window": best[0][1]["window"], "budget": int(frac * mem)})

                def by_window(lg):
                    return evaluate({"window": max(MiB, int(2 ** lg)),
                                     "budget": best[0][1]["budget"]})
                def at_budget():        # the best point so far, in by_budget's coordinate
                    return best[0][1]["budget"] / mem, best[0][0]

                def at_window():
                    return math.log2(best[0][1]["window"]), best[0][0]
                lw = (math.log2(WINDOW_RANGE[0]), math.log2(WINDOW_RANGE[1]))
                # budget, window, then the budget again (it depends on the window)
                if budget is None:
                    golden_max(by_budget, BUDGET_RANGE[0], BUDGET_RANGE[1], BUDGET_TOL,
                               start=at_budget())
                if window is None:
                    golden_max(by_window, lw[0], lw[1], WINDOW_TOL, start=at_window())
                if budget is None:
                    golden_max(by_budget, BUDGET_RANGE[0], BUDGET_RANGE[1], BUDGET_TOL,
                               start=at_budget())
        elif scheduler == "lms":
            for t, a in LMS_GRID:
                evaluate({"swapout_threshold": t, "swapin_ahead": a})
            if best[0] is not None:
                # the same refinement as the window's: golden section on each integer parameter
                n = max(2, len(seq.functions))

                def by_threshold(lg):
                    return evaluate({"swapout_threshold": max(1, int(round(2 ** lg))),
                                     "swapin_ahead": best[0][1]["swapin_ahead"]})

                def by_ahead(lg):
                    return evaluate({"swapout_threshold": best[0][1]["swapout_threshold"],
                                     "swapin_ahead": max(0, int(round(2 ** lg)) - 1)})
                def at_threshold():
                    return math.log2(best[0][1]["swapout_threshold"]), best[0][0]

                def at_ahead():
                    return math.log2(best[0][1]["swapin_ahead"] + 1), best[0][0]
                golden_max(by_threshold, 0.0, math.log2(n), LMS_TOL, start=at_threshold())
                golden_max(by_ahead, 0.0, math.log2(n), LMS_TOL, start=at_ahead())
                golden_max(by_threshold, 0.0, math.log2(n), LMS_TOL, start=at_threshold())
        else:
            evaluate({})
    if best[0] is None:
        return Plan(scheduler, {}, False, last[0], None, tried[0],
                    last[1] or "no feasible parameters")
    ips, params, sched, r = best[0]
    if extra:
        params = {**params, **extra}
    if compress:
        params["compress"] = compress
    return Plan(scheduler, params, True, r, sched, tried[0])


def _seq_fn(model):
    if callable(model):
        return model
    if isinstance(model, str):
        from vmalloc.offload.sequence.models import model_sequence

        return lambda b: model_sequence(model, b)
    if hasattr(model, "at_batch"):
        return model.at_batch
    raise InvalidArgumentError(
        f"model must be a model name, a sequence or a function of the batch, got {model!r}")


def _largest(ok: Callable[[int], bool], start=16, limit=1 << 16, resolution=0.02):
    """The largest b with ok(b), searching upward from ``start`` (doubling, then bisection to
    within ``resolution`` relative). 0 if ok(1) fails."""
    lo, hi = 0, None
    b = start
    while b <= limit:
        if ok(b):
            lo = b
            b *= 2
        else:
            hi = b
            break
    if lo == 0:
        if start > 1:
            return _largest(ok, 1, start - 1, resolution)
        return 0
    if hi is None:
        return lo
    while hi - lo > max(1, int(lo * resolution)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def in_core_reference(model, gpu="v100-16gb", allocator="caching"):
    """(batch, images/s): the in-core limit (the largest batch that runs with no swaps) and its
    speed, the paper's reference for "relative to in-core" (its 55 % at batch 1440 is 321
    images/s against 581 at the in-core limit 190)."""
    gpu = get_gpu(gpu)
    key = (model, gpu, allocator) if isinstance(model, str) else None
    if key is not None and key in _REFERENCES:
        return _REFERENCES[key]
    fn = _seq_fn(model)
    cache = {}

    def ok(b):
        r = simulate(fn(b), None, gpu=gpu, allocator=allocator)
        cache[b] = r
        return not r.out_of_memory

    b = _largest(ok, resolution=0.0)
    out = (0, None) if b == 0 else (b, cache[b].images_per_second)
    if key is not None:
        _REFERENCES[key] = out
    return out


_REFERENCES = {}    # (model name, GPU, allocator) -> in_core_reference()


def max_batch(model, gpu="v100-16gb", scheduler="window", allocator="virtual",
              min_relative_speed=0.55, reference=None, start=16, resolution=0.02,
              recompute=False, compress=None):
    """The largest batch that ``scheduler`` (its parameters planned by :func:`plan`) trains on
    ``gpu`` with ``allocator`` without running out of memory, at ``min_relative_speed`` or
    more of ``reference`` images/s (default: the in-core speed at the in-core limit, as the
    paper measures). ``model`` is a model name, a sequence recorded with a batch, or a
    function ``batch -> sequence``. Returns ``(batch, plan)``; ``(0, None)`` if none fits."""
    fn = _seq_fn(model)
    gpu = get_gpu(gpu)
    if scheduler != "none" and min_relative_speed:
        limit, speed = in_core_reference(fn, gpu)
        if reference is None:
            reference = speed
        # Speed rises with the batch up to the in-core limit (fixed per-function costs) and
        # falls past it (more bytes to move): search upward from the limit, not from 16.
        start = max(start, limit)
    plans = {}

    ref = (limit, speed) if scheduler != "none" and min_relative_speed else None

    def ok(b):
        p = plan(fn(b), gpu, scheduler, allocator, reference=ref, recompute=recompute,
                 compress=compress)
        plans[b] = p
        if not p.feasible:
            return False
        if reference and min_relative_speed:
            return p.result.images_per_second >= min_relative_speed * reference
        return True

    b = _largest(ok, start=start, resolution=resolution)
    return b, plans.get(b)
