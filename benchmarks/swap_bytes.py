"""Where a swap-only window schedule's bytes go (issue 16: ResNet-50 at batch 1440 on v100-16gb).

    PYTHONPATH=build/NAME/python python -P benchmarks/swap_bytes.py [--batch 1440]
        [--window BYTES --budget-fraction F]      # default: the planner's choice

Prints the bytes out and in, how many variables go out more than once, the bytes of the
activations live across the forward/backward turn and how many of them stay on the device
there, and the single-cut lower bound: at any point between two functions, the transient
variables used before and read after it, less what the budget leaves beside the next function,
must be on the host, so they went out at least once.
"""

import argparse
import collections

from vmalloc.offload.hardware.gpus import get_gpu
from vmalloc.offload.sequence.models import model_sequence
from vmalloc.offload.planning.planner import in_core_reference, plan
from vmalloc.offload.scheduling.window import WindowScheduler

GB = 1e9


def cut_bound(seq, budget):
    """(bytes, i): the largest single-cut lower bound on the bytes out, and the cut (after
    function i). Live across the cut: a transient variable used at or before i whose next use
    after i reads it (its content is needed). The next function's other variables must fit
    beside whatever of those stays."""
    uses = seq.uses()
    fns = seq.functions
    n = len(fns)
    reads = [set(f.inputs) for f in fns]
    best = (0, 0)
    # events: v is live across the cuts after functions u[k] .. u[k+1]-1 when u[k+1] reads v
    delta = [0] * (n + 1)
    for v in seq.variables:
        u = uses[v.id]
        if v.persistent:
            continue
        for a, b in zip(u, u[1:]):
            if v.id in reads[b]:
                delta[a] += v.nbytes
                delta[b] -= v.nbytes
    live = 0
    for i in range(n - 1):
        live += delta[i]
        nxt = fns[i + 1]
        # the next function's variables not live across the cut (born there, persistent, ...)
        other = sum(seq.nbytes(x) for x in nxt.uses
                    if seq.variables[x].persistent or not _across(uses[x], x, i, reads))
        if live - (budget - other) > best[0]:
            best = (live - (budget - other), i)
    return best


def _across(u, v, i, reads):
    """Whether v (uses u) is live across the cut after function i."""
    for a, b in zip(u, u[1:]):
        if a <= i < b:
            return v in reads[b]
    return False


def resident_at(sched, seq, cut):
    """Bytes of the transient variables live across the cut, by their state after function
    ``cut``: on the device or on the host (a swap-out issued counts as on the host)."""
    uses = seq.uses()
    reads = [set(f.inputs) for f in seq.functions]
    state = {}
    for i, st in enumerate(sched.steps[:cut + 1]):
        for v in st.drop + st.wait_swap_out:
            state[v] = "host"
        for v in st.allocate + st.swap_in:
            state[v] = "device"
        for v in st.free:
            state[v] = "freed"
        for v in st.swap_out:
            state[v] = "host"
    out = collections.Counter()
    for v in seq.variables:
        u = uses[v.id]
        if not v.persistent and _across(u, v.id, cut, reads):
            out[state.get(v.id, "absent")] += v.nbytes
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1440)
    ap.add_argument("--gpu", default="v100-16gb")
    ap.add_argument("--window", type=int)
    ap.add_argument("--budget-fraction", type=float)
    args = ap.parse_args()
    seq = model_sequence("resnet50", args.batch)
    if args.window is None or args.budget_fraction is None:
        p = plan(seq, args.gpu, "window", "virtual",
                 reference=in_core_reference("resnet50", args.gpu))
        sched = p.schedule
        print(f"planned: {p.params}, {p.result.images_per_second:.1f} images/s")
    else:
        budget = int(args.budget_fraction * get_gpu(args.gpu).memory_bytes)
        sched = WindowScheduler(args.window, budget, drop=True).schedule(seq)
    sched.check(seq, sched.budget)
    var = seq.variables
    outs = collections.Counter(sched.swapped_out())
    print(f"out {sched.swap_out_bytes(seq) / GB:.2f} GB, in {sched.swap_in_bytes(seq) / GB:.2f}"
          f" GB, dropped {sum(var[v].nbytes for v in sched.dropped()) / GB:.2f} GB; "
          f"{len(outs)} variables out, {sum(c > 1 for c in outs.values())} of them more than once; "
          f"persistent {sum(var[v].nbytes * c for v, c in outs.items() if var[v].persistent) / GB:.2f} GB")
    bound, cut = cut_bound(seq, sched.budget)
    uses = seq.uses()
    reads = [set(f.inputs) for f in seq.functions]
    across = sum(var[v].nbytes for v in sched.swapped_out()
                 if not var[v].persistent and _across(uses[v], v, cut, reads))
    where = resident_at(sched, seq, cut)
    print(f"cut after function {cut} ({seq.functions[cut].name}): live across it "
          f"{sum(where.values()) / GB:.2f} GB, on the device {where['device'] / GB:.2f} GB; "
          f"out and live across it {across / GB:.2f} GB; lower bound {bound / GB:.2f} GB out "
          f"(budget {sched.budget / GB:.2f} GB)")
    for v, c in sorted(outs.items(), key=lambda t: -var[t[0]].nbytes):
        if var[v].nbytes > 1e9 and not _across(uses[v], v, cut, reads):
            print(f"  not across the cut: {var[v].name} {var[v].nbytes / GB:.2f} GB, uses {uses[v]}")


if __name__ == "__main__":
    main()
