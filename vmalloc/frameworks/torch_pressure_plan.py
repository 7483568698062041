"""The plan of the steady state under pressure (:mod:`vmalloc.frameworks.torch_pressure`):
the probation's swaps moved to the boundaries around them, and the bound of the device bytes
that costs. Gap g lies between boundaries g - 1 and g (gap n: after the last one, until the
iteration's end); a swap noted in gap g is replayed at boundary g (a swap-out: the first one
after it) or g - 1 (a swap-in: the last one before it), so the storage is out in the replay
only while it was out in the probation. The probation's device bytes were sampled after each
op and at each boundary, on one clock with its swaps: a storage the replay keeps longer adds
its bytes to the samples in between, and the largest sum bounds the replay's bytes."""

from __future__ import annotations

import bisect

from vmalloc.frameworks.torch_pressure_boundaries import UNPACK


class _Plan:
    def __init__(self, pressure):
        self.n = len(pressure.keys)
        # An asynchronous backend's swap-out is waited for at the next boundary where the
        # replay works, not at once (its device bytes are held until then).
        self.deferred = pressure.deferred
        self.outs = []           # (probation's release time, boundary, bytes) of each swap-out
        self.times = pressure.times + [float("inf")]     # (boundary n: the iteration's end)
        self.holds = []          # (from time, to time, bytes) the replay holds longer
        self.actions = {}        # boundary (n: the iteration's end) -> [(what, slot)]
        self.slots = set()       # boundaries whose exposed storage the replay binds
        self.cycle = []          # persistent slots out across the iteration's boundary

    def act(self, at, what, slot):
        self.actions.setdefault(at, []).append((what, slot))
        if not isinstance(slot, tuple):
            self.slots.add(slot)

    def _held(self, t, when, nb):
        """What replaying at time ``when`` a swap the probation made at time t holds: out
        later or in earlier, the bytes meanwhile; else room meanwhile."""
        return (t, when, nb) if when > t else (when, t, -nb)

    def out_at(self, t, uses, exposed=0):
        """The first boundary after the storage's last use before time t (the probation's
        swap-out: an eviction made room inside a later op, which has no boundary of its
        own) and not before the boundary that exposes it."""
        last = max((u for u in uses if u < t), default=-1)
        return max(bisect.bisect_right(self.times, last), exposed >> 16)

    def in_at(self, t, uses):
        """The last boundary before its next use after time t (the probation's swap-in: a
        prefetch may come long before the use)."""
        use = next((u for u in uses if u > t), float("inf"))
        return bisect.bisect_left(self.times, use) - 1

    def out(self, slot, w, at, nb):
        """A swap-out replayed at boundary ``at``; the probation's runtime counted its bytes
        until time w (when it waited for the copy)."""
        if at <= self.n:
            self.act(at, "out", slot)
        self.outs.append((w, at, nb))

    def release_outs(self):
        """Each swap-out's bytes held from the probation's release (its wait) to the replay's:
        its own boundary, or deferred, the next one after it where the replay works (the
        iteration's end if none); room meanwhile if the replay's comes first."""
        work = sorted({at for at in self.actions if at < self.n} | {s >> 16 for s in self.slots})
        for t, at, nb in self.outs:
            if self.deferred and at < self.n:
                k = bisect.bisect_right(work, at)
                at = work[k] if k < len(work) else self.n
            self.holds.append(self._held(t, self.times[min(at, self.n)], nb))

    def swap_in(self, slot, t, at, nb):
        self.act(at, "in", slot)
        when = self.times[at]
        self.holds.append((when, t, nb) if when < t else (t, when, -nb))

    def pair(self, slot, t1, t2, nb, exposed, uses, w):
        """A storage out from time t1 to t2 in the probation (its bytes counted until w)."""
        at_out, at_in = self.out_at(t1, uses, exposed), self.in_at(t2, uses)
        if at_out < at_in:
            self.out(slot, w, at_out, nb)
            self.swap_in(slot, t2, at_in, nb)
        else:                                  # no boundary between: stays resident
            self.holds.append((w, t2, nb))

    def bound(self, samples):
        """The largest device bytes of the replay: each sample plus what is held over it."""
        edges = sorted([(a, nb) for a, b, nb in self.holds if b > a]
                       + [(b, -nb) for a, b, nb in self.holds if b > a])
        # (at one time, a hold's end comes before another's start: sorted by bytes)
        best, held, i = 0, 0, 0
        for t, b in samples:
            while i < len(edges) and edges[i][0] <= t:
                held += edges[i][1]
                i += 1
            best = max(best, b + held)
        return best


def _spans(run, uses):
    """A storage's swaps as the times it was out, [(out, in)] (None: out at the iteration's
    start or end), spans with no use between them merged; or why not."""
    spans = []
    if run and run[0][1] == "in":
        run = [(None, "out", None, None)] + run
    for i in range(0, len(run), 2):
        if run[i][1] != "out" or (i + 1 < len(run) and run[i + 1][1] != "in"):
            return "a storage was swapped in or out twice"
        t1, t2 = run[i][3], run[i + 1][3] if i + 1 < len(run) else None
        if spans and not any(spans[-1][1] < u < t1 for u in uses):
            spans[-1] = (spans[-1][0], t2)      # (brought back for nothing: stays out)
        else:
            spans.append((t1, t2))
    if spans == [(None, None)]:
        return "a storage was out throughout the iteration"
    return spans


def _released(waits, t1, t2):
    """When the probation's runtime stopped counting a storage swapped out at t1 (and back at
    t2, None: not in this iteration): at the first wait for its copy in between, else (no wait
    noted) at t1 itself, as if at once."""
    k = bisect.bisect_left(waits, t1)
    if k < len(waits) and (t2 is None or waits[k] <= t2):
        return waits[k]
    return t1


def _resident(plan, run, waits):
    """A storage the replay cannot swap: held over every span the probation had it out."""
    t1 = None
    for _, what, nbytes, t in run:
        if what == "out":
            t1 = t
        elif t1 is not None:
            plan.holds.append((_released(waits, t1, t), t, nbytes))
            t1 = None
    if t1 is not None:
        plan.holds.append((_released(waits, t1, None), float("inf"), nbytes))


class Probation:
    """The probation as a plan sees it, with the boundaries of the kinds in ``drop`` left out
    (renumbered): a storage is then named by its first exposure at a boundary kept, and a
    swap's gap counts the boundaries kept before it. Why: each boundary is a Python call in
    every steady step, and a plan that fits the budget without some kind of them saves those
    calls (the module forward post-hooks: a tenth of the boundaries, and PyTorch's slower
    module call path while any global forward hook is registered). ``deferred``: the
    swap-outs are waited for at the next boundary where the replay works (an asynchronous
    backend), so their bytes are held until then."""

    def __init__(self, pressure, drop=frozenset(), deferred=False):
        keep = [i for i, key in enumerate(pressure.keys) if key[0] not in drop]
        renumber = {i: j for j, i in enumerate(keep)}
        self.drop = drop
        # (an unpack's key names its pack's boundary: renumbered too)
        self.keys = [key if key[0] != UNPACK else (UNPACK, renumber[key[1]])
                     for key in (pressure.keys[i] for i in keep)]
        self.times = [pressure.times[i] for i in keep]
        self.log = [(bisect.bisect_left(keep, entry[0]),) + entry[1:] for entry in pressure.log]
        self.exposed = {}
        for buf, slots in pressure.exposed.items():
            for slot in slots:
                j = renumber.get(slot >> 16)
                if j is not None:
                    self.exposed[buf] = j << 16 | slot & 0xFFFF
                    break
        self.uses, self.samples = pressure.uses, pressure.samples
        self.foreign, self.driver = pressure.foreign, pressure.driver
        self.deferred = deferred
        self.excess = 0


def make_plan(pressure):
    """((actions by boundary, slots bound, cycle, bound of the device bytes), None), or
    (None, why); ``pressure``: a :class:`Probation`."""
    if pressure.foreign is not None:
        return None, pressure.foreign
    plan = _Plan(pressure)
    runs = {}
    for gap, what, slot, nbytes, t in pressure.log:
        runs.setdefault(slot, []).append((gap, what, nbytes, t))
    for slot, run in runs.items():
        # (the probation's waits for swap-outs: when its runtime released their bytes)
        waits = sorted(t for _, what, _, t in run if what == "wait")
        run = [event for event in run if event[1] != "wait"]
        uses = pressure.uses.get(slot, ())
        if slot is None:
            return None, "a storage it swapped was not the driver's"
        persistent = isinstance(slot, tuple)
        exposed = 0
        if not persistent:
            exposed = pressure.exposed.get(slot)
            if exposed is None:
                # Never at a boundary (a gradient summed inside the engine before it reaches
                # a parameter: tied weights): it stays resident, its bytes counted.
                _resident(plan, run, waits)
                continue
            slot = exposed
        spans = _spans(run, uses)
        if isinstance(spans, str):
            return None, spans
        nb = run[0][2]
        for t1, t2 in spans:
            if t1 is None:
                # Out since the last iteration (a persistent storage the optimizer step left
                # out): back before its first use, out again at the iteration's end.
                if not persistent or spans[-1][1] is not None:
                    return None, "a storage was out when the iteration began"
                plan.swap_in(slot, t2, plan.in_at(t2, uses), nb)
                plan.cycle.append(slot)
            elif t2 is None:
                if persistent and spans[0][0] is not None:
                    return None, "a persistent storage stays out at the iteration's end"
                plan.out(slot, _released(waits, t1, None), plan.out_at(t1, uses, exposed),
                         nb)   # (or freed out)
            else:
                plan.pair(slot, t1, t2, nb, exposed, uses, _released(waits, t1, t2))
    plan.release_outs()
    bound = plan.bound(pressure.samples)
    budget = pressure.driver.runtime.budget
    pressure.excess = bound - budget if budget is not None and bound > budget else 0
    if pressure.excess:
        return None, (f"replayed at the boundaries the swaps would hold up to {bound} bytes, "
                      f"over the budget of {budget}")
    for acts in plan.actions.values():
        acts.sort(key=lambda a: a[0] != "out")     # room first
    return (plan.actions, plan.slots, plan.cycle, bound), None
