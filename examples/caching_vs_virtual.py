"""Best-fit caching (PyTorch's policy) against virtual addressing on the same allocations.

Runs on an emulated device with no GPU. Two workloads:

1. The fragmentation pattern in miniature: ten 4 MiB tensors, every other one freed, then five
   6 MiB tensors. The caching allocator cannot put a 6 MiB tensor into a 4 MiB hole, nor give a
   half-used segment back, so it needs new segments; the virtual allocator maps any free chunks
   into a new contiguous range.
2. Tensor sizes that drift upward phase by phase, freed out of order, with some long-lived
   tensors pinning segments. For each allocator: peak requested and peak reserved with no
   capacity limit, the smallest device (in 16 MiB steps) that runs the workload, and the
   memory-management driver calls made with no limit.

Usage: python examples/caching_vs_virtual.py
"""

import random

import vmalloc

MiB = 1 << 20


def allocators():
    """(label, factory(device)) of every allocator built into this vmalloc."""
    kinds = [("caching (pytorch)", lambda d: vmalloc.CachingAllocator(d)),
             ("caching (max_split 20MiB)",
              lambda d: vmalloc.CachingAllocator(d, max_split_size="20MiB"))]
    if hasattr(vmalloc, "VirtualAllocator"):
        kinds.append(("virtual (2 MiB chunks)", lambda d: vmalloc.VirtualAllocator(d)))
    return kinds


def interleaved_trace():
    """Ten 4 MiB tensors, every other one freed, then five 6 MiB tensors."""
    trace = [(+1, k, 4 * MiB) for k in range(10)]
    trace += [(-1, k, 0) for k in range(0, 10, 2)]
    trace += [(+1, k, 6 * MiB) for k in range(10, 15)]
    return trace


def drifting_trace(phases=8, per_phase=60, seed=0):
    """[(+1, id, size) | (-1, id, 0)]: tensor sizes drift upward phase by phase (as when
    activations grow with sequence length, or a swap schedule changes what is resident); about
    12 short-lived tensors are live at a time, freed out of order, and 15 % of the tensors live
    for two more phases, pinning the segments they sit in."""
    rng = random.Random(seed)
    short, pinned, trace, key = [], [], [], 0
    for phase in range(phases):
        base = (3 + 2 * phase) * MiB
        for _ in range(per_phase):
            trace.append((+1, key, base + rng.randrange(0, 2 * MiB, 512)))
            if rng.random() < 0.15:
                pinned.append((phase + 2, key))
            else:
                short.append(key)
            key += 1
            while len(short) > 12:
                trace.append((-1, short.pop(rng.randrange(len(short))), 0))
        trace += [(-1, k, 0) for until, k in pinned if until <= phase]
        pinned = [(until, k) for until, k in pinned if until > phase]
    return trace


def replay(factory, trace, capacity=None):
    """Runs the trace on a fresh unbacked device: (stats, memory-management driver calls),
    or (None, calls) if it ran out of memory."""
    device = vmalloc.HostDevice(capacity=capacity, backed=False)
    allocator = factory(device)
    ptrs = {}
    try:
        for op, key, size in trace:
            if op > 0:
                ptrs[key] = allocator.allocate(size)
            else:
                allocator.deallocate(ptrs.pop(key))
        stats = allocator.stats()
    except vmalloc.OutOfMemoryError:
        stats = None
    return stats, device.counters()["memory_management_calls"]


def smallest_device(factory, trace, step):
    stats, _ = replay(factory, trace)
    lo, hi = 0, -(-stats.peak_reserved_bytes // step)   # in steps; hi always fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if replay(factory, trace, capacity=mid * step)[0] is None:
            lo = mid
        else:
            hi = mid
    return hi * step


def report(title, trace, step):
    print(title)
    print(f"   {'allocator':27} {'peak req':>10} {'peak res':>10} {'utilization':>12} "
          f"{'smallest device':>16} {'mm calls':>9}")
    for label, factory in allocators():
        s, calls = replay(factory, trace)
        print(f"   {label:27} {vmalloc.format_size(s.peak_requested_bytes):>10} "
              f"{vmalloc.format_size(s.peak_reserved_bytes):>10} {s.utilization:>12.2f} "
              f"{vmalloc.format_size(smallest_device(factory, trace, step)):>16} {calls:>9}")


def main():
    report("1. ten 4 MiB tensors, every other one freed, then five 6 MiB tensors",
           interleaved_trace(), step=2 * MiB)
    trace = drifting_trace()
    report(f"\n2. drifting tensor sizes with some long-lived tensors ({len(trace)} events)",
           trace, step=16 * MiB)
    print("\npeak res and mm calls (memory-management driver calls) are measured without a\n"
          "capacity limit; smallest device is the least capacity the workload runs in.")


if __name__ == "__main__":
    main()
