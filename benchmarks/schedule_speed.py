"""How long the schedulers take: a synthetic 10^5-function sequence (and the shipped models,
when vmalloc.offload.models exists). Prints seconds per scheduler.

    PYTHONPATH=/work/devpy python benchmarks/schedule_speed.py [--functions N] [--check]
"""

import argparse
import random
import time

from vmalloc.offload import FunctionSequence, InCoreScheduler, LMSScheduler, VDNNScheduler, WindowScheduler


def synthetic(n, seed=0):
    """A deep network's iteration: n/2 forward functions (each reads the previous activation
    and a weight, writes an activation), then the backward pass in reverse (reads the saved
    activation and the incoming gradient, writes weight and input gradients), 1 to 64 MiB each."""
    rng = random.Random(seed)
    seq = FunctionSequence(name=f"synthetic-{n}")
    layers = n // 2
    acts = [seq.add_variable(rng.randint(1, 64) << 20, name="x")]
    weights = []
    for k in range(layers):
        w = seq.add_variable(rng.randint(1, 16) << 20, persistent=True, name=f"w{k}")
        a = seq.add_variable(rng.randint(1, 64) << 20, name=f"a{k}")
        seq.add_function([acts[-1], w], [a], name=f"layer{k}")
        weights.append(w)
        acts.append(a)
    grad = seq.add_variable(acts[-1] and seq.nbytes(acts[-1]), name="dloss")
    for k in range(layers - 1, -1, -1):
        gin = seq.add_variable(seq.nbytes(acts[k]), name=f"g{k}")
        gw = seq.add_variable(seq.nbytes(weights[k]), name=f"gw{k}")
        seq.add_function([grad, acts[k], weights[k]], [gin, gw], name=f"layer{k}_backward")
        grad = gin
    return seq


def timed(label, fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t
    print(f"{label:40s} {dt:8.3f} s")
    return out


def run(seq, check):
    peak = seq.in_core_peak()
    print(seq.summary())
    for label, sched, budget in [
            ("window (window=peak/8, budget=peak/4)", WindowScheduler(peak // 8, peak // 4), peak // 4),
            ("window persistent=resident", WindowScheduler(peak // 8, max(peak // 4, seq.persistent_bytes() * 2), "resident"), None),
            ("lms", LMSScheduler(), None), ("vdnn", VDNNScheduler(), None),
            ("none", InCoreScheduler(), None)]:
        try:
            s = timed(label, sched.schedule, seq)
        except Exception as e:  # a budget a function cannot fit: say so and go on
            print(f"{label:40s} {type(e).__name__}: {e}")
            continue
        if check:
            timed("  check", s.check, seq, budget)
    # recompute considered: candidates (link vs compute time per variable), the expanded
    # sequence, its window schedule and the swap-only one it must not move more bytes than
    from vmalloc.offload.planner import schedule_with_choices
    params = {"window": peak // 8, "budget": peak // 4, "drop": True}
    try:
        s = timed("window + drop + recompute considered", schedule_with_choices, seq, "window",
                  params, "v100-16gb", "memory")
        print(f"{'':40s} recomputed functions {s.recomputed_functions()}")
    except Exception as e:  # noqa: BLE001
        print(f"{'window + recompute':40s} {type(e).__name__}: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--functions", type=int, default=100_000)
    ap.add_argument("--check", action="store_true", help="also time Schedule.check")
    args = ap.parse_args()
    run(timed("build synthetic sequence", synthetic, args.functions), args.check)
    try:
        from vmalloc.offload import models
    except ImportError:
        return
    for name in getattr(models, "MODELS", ()):
        try:
            seq = models.model_sequence(name)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: cannot build ({e})")
            continue
        run(seq, args.check)


if __name__ == "__main__":
    main()
