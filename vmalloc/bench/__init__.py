"""The allocation benchmark: ``vmalloc bench`` or ``python -m vmalloc.bench``.

Two measurements per allocator, on an unbacked :class:`vmalloc.HostDevice` (no GPU needed):

* **cache hit**: nanoseconds per allocate+deallocate pair once the memory is cached, timed in
  a C++ loop (the allocator's own cost) and from Python with :mod:`timeit` (what a framework
  calling through the Python API pays).
* **training-like pattern**: a deterministic step of forward activations, backward
  temporaries and gradients, and optimizer frees, repeated. For each iteration: the
  memory-management driver calls (``cuMemCreate``, ``cuMemMap``, ...), all driver calls, and
  their modeled time on a GPU (the device's cost model: published A100 figures). The first
  iteration warms the cache up; afterwards a caching allocator should make no call at all.

Timing figures depend on the machine and its load; the driver-call counts do not.
"""

import argparse
import json
import os
import platform
import random
import sys
import timeit

# The package's one allocator and accounting-device factories (also bench's public names).
from vmalloc.allocator_kinds import accounting_device as make_device
from vmalloc.allocator_kinds import make_allocator

KiB = 1 << 10
MiB = 1 << 20

#: The kinds measured when none is named (any of :data:`vmalloc.allocator_kinds.NAMES` may be).
DEFAULT_ALLOCATORS = ("virtual", "caching")


def available_allocators(names=DEFAULT_ALLOCATORS):
    """Those of ``names`` whose class is built."""
    from vmalloc import allocator_kinds

    return [name for name in names if allocator_kinds.get(name).available]


# --- cache hits -----------------------------------------------------------------------------

def hit_cpp(allocator, nbytes, pairs):
    """ns per allocate+deallocate pair of ``nbytes``, the loop in C++."""
    from vmalloc.bench import _bench

    return _bench.time_alloc_free_pairs(allocator, nbytes, pairs)["ns_per_pair"]


def hit_python(allocator, nbytes, pairs):
    """ns per allocate+deallocate pair of ``nbytes`` called from Python (best of 3 runs)."""
    allocate, deallocate = allocator.allocate, allocator.deallocate
    deallocate(allocate(nbytes), nbytes)  # warm-up: cached from now on
    timer = timeit.Timer("d(a(n), n)", globals={"a": allocate, "d": deallocate, "n": nbytes})
    best = min(timer.repeat(repeat=3, number=pairs))
    return best / pairs * 1e9


# --- the training-like pattern --------------------------------------------------------------

def training_layers(layers=48, seed=0):
    """Activation sizes of a deterministic model: many small tensors and some large ones."""
    rng = random.Random(seed)
    choices = [2 * KiB, 16 * KiB, 96 * KiB, 700 * KiB, 3 * MiB, 9 * MiB, 25 * MiB]
    weights = [4, 4, 3, 3, 3, 2, 1]
    return rng.choices(choices, weights=weights, k=layers)


def training_step(allocator, layers):
    """One step: forward activations, backward (a temporary and a gradient per layer, the
    activation freed), then the optimizer frees the gradients."""
    allocate, deallocate = allocator.allocate, allocator.deallocate
    activations = [allocate(n) for n in layers]
    gradients = []
    for n, a in zip(reversed(layers), reversed(activations)):
        tmp = allocate(n // 2 + 1)
        gradients.append((allocate(n), n))
        deallocate(tmp)
        deallocate(a, n)
    for g, n in gradients:
        deallocate(g, n)


def pattern(name, iterations, layers, capacity):
    """Driver calls and modeled driver time per iteration of :func:`training_step`."""
    device = make_device(capacity)
    allocator = make_allocator(name, device)
    sizes = training_layers(layers)
    parameters = [allocator.allocate(n) for n in sizes]  # live for the whole run
    rows = []
    for i in range(iterations):
        before = device.counters()
        training_step(allocator, sizes)
        after = device.counters()
        calls = {k: after[k] - before[k] for k in after
                 if isinstance(after[k], int) and not k.startswith("bytes_")}
        rows.append({
            "iteration": i + 1,
            "memory_management_calls": calls.pop("memory_management_calls"),
            "driver_calls": sum(calls.values()),
            "calls": {k: v for k, v in calls.items() if v},
            "modeled_seconds": after["modeled_seconds"] - before["modeled_seconds"],
        })
    stats = allocator.stats()
    for p, n in zip(parameters, sizes):
        allocator.deallocate(p, n)
    return {"allocator": name, "layers": layers, "iterations": rows,
            "peak_requested_bytes": stats.peak_requested_bytes,
            "peak_reserved_bytes": stats.peak_reserved_bytes}


# --- the whole benchmark ---------------------------------------------------------------------

def run(allocators=None, sizes=(4 * KiB, 3 * MiB), pairs=1_000_000, python_pairs=200_000,
        iterations=5, layers=48, capacity=8 << 30):
    """Runs every measurement; returns a JSON-ready dict."""
    allocators = list(allocators or available_allocators())
    hits = []
    for name in allocators:
        allocator = make_allocator(name, make_device())
        for n in sizes:
            hits.append({"allocator": name, "nbytes": n,
                         "cpp_ns_per_pair": hit_cpp(allocator, n, pairs),
                         "python_ns_per_pair": hit_python(allocator, n, python_pairs)})
    patterns = [pattern(name, iterations, layers, capacity) for name in allocators]
    return {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "settings": {"pairs": pairs, "python_pairs": python_pairs, "iterations": iterations,
                     "layers": layers, "capacity": capacity,
                     "device": "HostDevice(backed=False)"},
        "hit": hits,
        "pattern": patterns,
    }


def _ns(value):
    return f"{value / 1000:.2f} us" if value >= 1000 else f"{value:.0f} ns"


def format_table(results):
    """The results as readable text."""
    from vmalloc.sizes import format_size

    s = results["settings"]
    # As wide as the longest kind's name ("expandable-segments"), so the columns line up.
    w = max([14] + [len(r["allocator"]) for r in results["hit"] + results["pattern"]])
    lines = [f"cache hit: one allocate+deallocate pair ({s['pairs']:,} pairs in C++, "
             f"{s['python_pairs']:,} from Python; {s['device']})",
             f"  {'allocator':<{w}} {'size':>10} {'C++ loop':>10} {'Python':>10}"]
    for h in results["hit"]:
        lines.append(f"  {h['allocator']:<{w}} {format_size(h['nbytes']):>10} "
                     f"{_ns(h['cpp_ns_per_pair']):>10} {_ns(h['python_ns_per_pair']):>10}")
    lines.append("")
    lines.append(f"training-like pattern ({s['layers']} layers, {s['iterations']} iterations): "
                 "driver calls per iteration")
    lines.append(f"  {'allocator':<{w}} {'iteration':<13} {'mm calls':>9} {'all calls':>10} "
                 f"{'modeled driver time':>20}")
    for p in results["pattern"]:
        rows = p["iterations"]
        steady = rows[1:]
        shown = [("1 (warm-up)", rows[0])]
        if steady:
            mean = {k: sum(r[k] for r in steady) / len(steady)
                    for k in ("memory_management_calls", "driver_calls", "modeled_seconds")}
            shown.append((f"2-{len(rows)} (mean)", mean))
        for label, r in shown:
            lines.append(f"  {p['allocator']:<{w}} {label:<13} "
                         f"{r['memory_management_calls']:>9g} {r['driver_calls']:>10g} "
                         f"{r['modeled_seconds'] * 1e3:>17.3f} ms")
    return "\n".join(lines)


def main(argv=None):
    """Command line: ``vmalloc bench [--allocator NAME ...] [--json] [--quick] ...``."""
    from vmalloc import allocator_kinds
    from vmalloc.sizes import size_list_argument

    parser = argparse.ArgumentParser(
        prog="vmalloc bench",
        description="Allocation benchmark: cache-hit cost per allocate+deallocate pair (C++ "
                    "loop and Python), and driver calls per iteration of a training-like "
                    "pattern, on an unbacked emulated device.")
    parser.add_argument("--allocator", action="append", choices=allocator_kinds.NAMES,
                        help="allocator to measure (repeatable; default: "
                             f"{' and '.join(DEFAULT_ALLOCATORS)})")
    parser.add_argument("--sizes", type=size_list_argument, default="4KiB,3MiB",
                        help="request sizes of the cache-hit measurement (default 4KiB,3MiB)")
    parser.add_argument("--pairs", type=int, default=1_000_000,
                        help="pairs timed in the C++ loop (default 1000000)")
    parser.add_argument("--python-pairs", type=int, default=200_000,
                        help="pairs timed from Python (default 200000)")
    parser.add_argument("--iterations", type=int, default=5,
                        help="iterations of the training-like pattern (default 5)")
    parser.add_argument("--layers", type=int, default=48,
                        help="layers of the training-like pattern (default 48)")
    parser.add_argument("--quick", action="store_true",
                        help="small counts (a smoke test; timings are rough)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    for flag in ("pairs", "python_pairs", "iterations", "layers"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.quick:
        args.pairs, args.python_pairs = 20_000, 5_000
        args.iterations, args.layers = 3, 16
    allocators = args.allocator or available_allocators()
    if not allocators:
        print("vmalloc bench: no allocator is built", file=sys.stderr)
        return 1
    results = run(allocators, args.sizes, args.pairs, args.python_pairs, args.iterations,
                  args.layers)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    if not os.environ.get("OPENBLAS_NUM_THREADS") and not args.json:
        # NumPy's OpenBLAS threads (started at import) compete for the cores during the C++
        # loop: on 2 cores they added 20-35 ns per pair (docs/benchmarks.md).
        print("note: OPENBLAS_NUM_THREADS is not set; NumPy's BLAS threads may inflate the "
              "C++ timings on a small machine (set it to 1 before starting Python)",
              file=sys.stderr)
    return 0

