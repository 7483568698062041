"""Would virtual addressing fix my fragmentation? Replay a trace and read the answer.

Replays an allocation trace through the best-fit caching allocator (PyTorch's policy) and the
virtual allocator, in both of its placements (each allocation in whole chunks, and allocations
packed in virtual space), each on a fresh emulated device (accounting only, so no GPU and no
memory are needed). Prints what each reserved at its peak, its utilization (peak requested /
peak reserved), its driver calls, and the smallest device that runs the whole trace. With no
argument, the trace shipped with vmalloc (a Transformer language model's training steps).

Usage:
    python examples/replay_trace.py [TRACE] [--capacity SIZE] [--plot FILE.png]

TRACE is a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot), a PyTorch profiler
trace, an RMM log or a .vmtrace file. The same is
``vmalloc replay TRACE -a caching,virtual,virtual-packed``.
"""

import argparse

from vmalloc.replay import format_table, replay
from vmalloc.sizes import format_size

ALLOCATORS = ("caching", "virtual", "virtual-packed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", help="trace file (default: the built-in trace)")
    parser.add_argument("--capacity", help="device capacity such as 2GiB (default: unlimited)")
    parser.add_argument("--plot", help="write requested and reserved bytes over time here")
    args = parser.parse_args()

    results = replay(args.trace, ALLOCATORS, capacity=args.capacity)
    print(format_table(results))

    caching = results[0]
    best = min(results[1:], key=lambda r: r.min_capacity_bytes)
    saved = caching.min_capacity_bytes - best.min_capacity_bytes
    print()
    if saved > 0:
        print(f"Virtual addressing ({best.allocator}) runs this trace on a device "
              f"{format_size(saved)} smaller than best-fit caching needs: "
              f"{format_size(best.min_capacity_bytes)} instead of "
              f"{format_size(caching.min_capacity_bytes)} "
              f"({saved / caching.min_capacity_bytes:.1%} less).")
    else:
        print(f"Best-fit caching already runs this trace in "
              f"{format_size(caching.min_capacity_bytes)}; the best virtual allocator "
              f"({best.allocator}) needs {format_size(best.min_capacity_bytes)}.")

    if args.plot:
        from vmalloc.replay.plot import plot_results

        plot_results(results, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
