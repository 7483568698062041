"""A small HostDevice.read's wall time against how idle the machine is, for docs/benchmarks.md.

    PYTHONPATH=build/<name>/python python -P benchmarks/host_read_idle.py [--seconds S]

Reads 16 bytes in bursts of 5000 for S seconds (default 20) and bins each burst's time per
read by the machine's idle share during it (/proc/stat, Linux). A read handed to a stream's
thread costs two thread wakeups, dear when a core idles; one run on the caller's thread
costs the same at any idleness.
"""

import argparse
import time

import vmalloc

BINS = ((0.0, 0.05), (0.05, 0.3), (0.3, 0.6), (0.6, 1.01))


def idle_and_total():
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait, all


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    dev = vmalloc.HostDevice()
    allocator = vmalloc.CachingAllocator(dev)
    ptr = allocator.allocate(4096)
    dev.write(ptr, b"x" * 16)
    bursts = []
    end = time.time() + args.seconds
    while time.time() < end:
        idle0, total0 = idle_and_total()
        start = time.perf_counter()
        for _ in range(5000):
            dev.read(ptr, 16)
        per_read = (time.perf_counter() - start) / 5000
        idle1, total1 = idle_and_total()
        bursts.append(((idle1 - idle0) / max(1, total1 - total0), per_read))
    for lo, hi in BINS:
        times = sorted(t for idle, t in bursts if lo <= idle < hi)
        if times:
            print(f"machine idle {lo:.0%}-{min(hi, 1):.0%}: {len(times)} bursts, "
                  f"median {times[len(times) // 2] * 1e6:.1f} us a read, "
                  f"best {times[0] * 1e6:.1f} us")
    allocator.deallocate(ptr)


if __name__ == "__main__":
    main()
