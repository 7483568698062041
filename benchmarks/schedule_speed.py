"""How long the schedulers take: a synthetic 10^5-function sequence (and the shipped models,
when vmalloc.offload.sequence.models exists). Prints seconds per scheduler (the best of ``--repeat``
runs: the machine here is shared) and the ratio of "window + drop + recompute considered" to
the window scheduler alone measured in the same run, with ``python -m timeit pass``'s figure
before and after (this machine's speed varies about 4x: quote it beside every timing).

    PYTHONPATH=build/NAME/python python -P benchmarks/schedule_speed.py [--functions N] [--check]
        [--repeat K] [--synthetic-only]

Instruction counts, repeatable on a loaded machine (``--only`` runs one thing inside
``math.fsum``, so that callgrind collects that and nothing else)::

    valgrind --tool=callgrind --toggle-collect=math_fsum $(python -c 'import sys;
        print(sys.executable)') -P benchmarks/schedule_speed.py --functions 10000 --only choices
"""

import argparse
import math
import random
import time
import timeit

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


REPEAT = 1
TIMES = {}


def timeit_pass():
    """``python -m timeit pass``'s figure: nanoseconds per loop, the best of 5."""
    number, _ = timeit.Timer("pass").autorange()
    return min(timeit.repeat("pass", number=number, repeat=5)) / number * 1e9


def timed(label, fn, *args):
    best = math.inf
    for _ in range(REPEAT):
        t = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t)
    TIMES[label] = best
    print(f"{label:40s} {best:8.3f} s")
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
    from vmalloc.offload.planning.planner import schedule_with_choices
    params = {"window": peak // 8, "budget": peak // 4, "drop": True}
    try:
        s = timed("window + drop + recompute considered", schedule_with_choices, seq, "window",
                  params, "v100-16gb", "memory")
        ratio = TIMES["window + drop + recompute considered"] / \
            TIMES["window (window=peak/8, budget=peak/4)"]
        print(f"{'':40s} recomputed functions {s.recomputed_functions()}; {ratio:.2f}x the "
              "window scheduler alone")
    except Exception as e:  # noqa: BLE001
        print(f"{'window + recompute':40s} {type(e).__name__}: {e}")


def only(seq, what):
    """One scheduling of ``seq`` inside math.fsum (see the module docstring)."""
    from vmalloc.offload.planning.planner import schedule_with_choices
    peak = seq.in_core_peak()
    if what == "window":
        def fn():
            WindowScheduler(peak // 8, peak // 4).schedule(seq)
    else:
        def fn():
            schedule_with_choices(seq, "window", {"window": peak // 8, "budget": peak // 4,
                                                  "drop": True}, "v100-16gb", "memory")
    math.fsum((fn(), 0.0)[1] for _ in range(1))


def main():
    global REPEAT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--functions", type=int, default=100_000)
    ap.add_argument("--check", action="store_true", help="also time Schedule.check")
    ap.add_argument("--repeat", type=int, default=1, help="best of this many runs")
    ap.add_argument("--synthetic-only", action="store_true", help="not the shipped models")
    ap.add_argument("--only", choices=["window", "choices"],
                    help="run just this on the synthetic sequence, inside math.fsum")
    args = ap.parse_args()
    REPEAT = max(1, args.repeat)
    if args.only:
        # imported outside the counted call
        import vmalloc.offload.scheduling.recompute  # noqa: F401
        only(synthetic(args.functions), args.only)
        return
    print(f"{'timeit pass (before)':40s} {timeit_pass():8.2f} ns")
    run(timed("build synthetic sequence", synthetic, args.functions), args.check)
    print(f"{'timeit pass (after)':40s} {timeit_pass():8.2f} ns")
    if args.synthetic_only:
        return
    try:
        from vmalloc.offload.sequence import models
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
