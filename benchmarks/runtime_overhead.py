"""Python overhead of the out-of-core runtime per function boundary on a cache hit.

A schedule is followed, but every buffer the functions list is resident and the steps have
nothing to do: what remains is the runtime's own bookkeeping (matching the record, residency
checks, the schedule's empty steps). Target: <= 5 us per function.

    python benchmarks/runtime_overhead.py [--functions N] [--buffers K] [--iterations I]
"""

import argparse
import time

import vmalloc
from vmalloc.offload.runtime import Runtime


def measure(functions, buffers, iterations):
    dev = vmalloc.HostDevice(capacity="1GiB", granularity="2MiB")
    rt = Runtime(vmalloc.VirtualAllocator(dev), scheduler="none", budget="512MiB")
    params = [rt.allocate(1 << 20) for _ in range(buffers)]
    per_iteration = []
    for it in range(iterations):
        with rt.iteration():
            start = time.perf_counter()
            for i in range(functions):
                with rt.function(reads=params[:-1], writes=params[-1:], name="f"):
                    pass
            per_iteration.append((time.perf_counter() - start) / functions)
    stats = rt.stats()
    assert stats["scheduled_iterations"] == iterations - 1, stats
    assert stats["diverged_iterations"] == 0, stats
    return min(per_iteration[1:]), sorted(per_iteration[1:])[len(per_iteration[1:]) // 2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=20000)
    parser.add_argument("--buffers", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args(argv)
    best, median = measure(args.functions, args.buffers, args.iterations)
    print(f"runtime function boundary ({args.buffers} buffers, scheduled, cache hit): "
          f"best {best * 1e6:.2f} us, median {median * 1e6:.2f} us per function")


if __name__ == "__main__":
    main()
