"""Would virtual addressing fix my fragmentation? Replay a trace and read the answer.

Replays an allocation trace through the best-fit caching allocator (PyTorch's policy) and the
virtual allocator, each on a fresh emulated device (accounting only, so no GPU and no memory
are needed), and prints what each reserved at its peak, its utilization (peak requested /
peak reserved), its driver calls, and the smallest device that runs the whole trace. With no
argument, the trace shipped with vmalloc (a Transformer language model's training steps).

Usage:
    python examples/replay_trace.py [TRACE] [--capacity SIZE] [--plot FILE.png]

TRACE is a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot), a PyTorch profiler
trace, an RMM log or a .vmtrace file. The same is ``vmalloc replay TRACE``.
"""

import argparse

from vmalloc.replay import format_table, replay
from vmalloc.sizes import format_size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", help="trace file (default: the built-in trace)")
    parser.add_argument("--capacity", help="device capacity such as 2GiB (default: unlimited)")
    parser.add_argument("--plot", help="write requested and reserved bytes over time here")
    args = parser.parse_args()

    results = replay(args.trace, ("caching", "virtual"), capacity=args.capacity)
    print(format_table(results))

    caching, virtual = results
    saved = caching.min_capacity_bytes - virtual.min_capacity_bytes
    print()
    if saved > 0:
        print(f"Virtual addressing runs this trace on a device {format_size(saved)} smaller "
              f"({format_size(virtual.min_capacity_bytes)} instead of "
              f"{format_size(caching.min_capacity_bytes)}).")
    else:
        print(f"Best-fit caching already runs this trace in "
              f"{format_size(caching.min_capacity_bytes)}; the virtual allocator needs "
              f"{format_size(virtual.min_capacity_bytes)} (chunk rounding costs it "
              f"{format_size(virtual.peak_internal_fragmentation_bytes)} at its peak).")

    if args.plot:
        from vmalloc.plot import plot_results

        plot_results(results, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
