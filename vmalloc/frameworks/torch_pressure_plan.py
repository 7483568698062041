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


class _Plan:
    def __init__(self, pressure):
        self.n = len(pressure.keys)
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
        return max(bisect.bisect_right(self.times, last), exposed)

    def in_at(self, t, uses):
        """The last boundary before its next use after time t (the probation's swap-in: a
        prefetch may come long before the use)."""
        use = next((u for u in uses if u > t), float("inf"))
        return bisect.bisect_left(self.times, use) - 1

    def out(self, slot, t, at, nb):
        if at <= self.n:
            self.act(at, "out", slot)
        self.holds.append(self._held(t, self.times[min(at, self.n)], nb))

    def swap_in(self, slot, t, at, nb):
        self.act(at, "in", slot)
        when = self.times[at]
        self.holds.append((when, t, nb) if when < t else (t, when, -nb))

    def pair(self, slot, t1, t2, nb, exposed, uses):
        """A storage out from time t1 to t2 in the probation."""
        at_out, at_in = self.out_at(t1, uses, exposed), self.in_at(t2, uses)
        if at_out < at_in:
            self.out(slot, t1, at_out, nb)
            self.swap_in(slot, t2, at_in, nb)
        else:                                  # no boundary between: stays resident
            self.holds.append((t1, t2, nb))

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


def make_plan(pressure):
    """((actions by boundary, slots bound, cycle, bound of the device bytes), None), or
    (None, why)."""
    plan = _Plan(pressure)
    n = plan.n
    runs = {}
    for gap, what, slot, nbytes, t in pressure.log:
        runs.setdefault(slot, []).append((gap, what, nbytes, t))
    for slot, run in runs.items():
        uses = pressure.uses.get(slot, ())
        if slot is None:
            return None, "a storage it swapped was not the driver's"
        persistent = isinstance(slot, tuple)
        exposed = 0
        if not persistent:
            exposed = pressure.exposed.get(slot)
            if exposed is None:
                return None, "a storage it swapped was never seen at a boundary"
            slot = exposed
        if run[0][1] == "in":
            # Out since the last iteration (a persistent storage the optimizer step left out):
            # back at its boundary, out again at the iteration's end.
            if not persistent or run[-1][1] != "out" or run[0][0] < 1:
                return None, "a storage was out when the iteration began"
            k2, _, nb, t2 = run.pop(0)
            k1, _, _, t1 = run.pop()
            at_in, at_out = plan.in_at(t2, uses), plan.out_at(t1, uses)
            if at_out <= at_in:
                return None, "a persistent storage is swapped in and out with no use between"
            plan.swap_in(slot, t2, at_in, nb)
            plan.out(slot, t1, at_out, nb)
            plan.cycle.append(slot)
        for i in range(0, len(run), 2):
            k1, what, nb, t1 = run[i]
            if what != "out":
                return None, "a storage was swapped in twice"
            if i + 1 < len(run):
                plan.pair(slot, t1, run[i + 1][3], nb, exposed, uses)
            elif persistent:
                return None, "a persistent storage stays out at the iteration's end"
            else:                       # freed while out
                plan.out(slot, t1, plan.out_at(t1, uses, exposed), nb)
    bound = plan.bound(pressure.samples)
    budget = pressure.driver.runtime.budget
    if budget is not None and bound > budget:
        return None, (f"replayed at the boundaries the swaps would hold up to {bound} bytes, "
                      f"over the budget of {budget}")
    for acts in plan.actions.values():
        acts.sort(key=lambda a: a[0] != "out")     # room first
    return (plan.actions, plan.slots, plan.cycle, bound), None
