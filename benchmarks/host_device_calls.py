"""Wall time of HostDevice's emulated driver calls and copies, for docs/benchmarks.md.

    PYTHONPATH=build/<name>/python python benchmarks/host_device_calls.py [--chunks N]

Creates, maps, enables, unmaps and releases N chunks of 2 MiB (default 2,000) on a backed and
an unbacked device, timing each phase through the Python API (so a call's figure includes
about 0.1-0.3 us of Python call overhead), then times 256 MiB copies. Best of 3 runs. These
are the emulator's own costs on this machine; a GPU's are modeled separately
(Device.counters()["modeled_seconds"]).
"""

import argparse
import ctypes
import time

import vmalloc

MiB = 1 << 20


def calls(backed, n):
    dev = vmalloc.HostDevice(backed=backed)
    g = dev.granularity
    times = {}
    t = time.perf_counter()
    handles = [dev.create(g) for _ in range(n)]
    times["create"] = time.perf_counter() - t
    t = time.perf_counter()
    base = dev.reserve(n * g)
    times["reserve"] = time.perf_counter() - t
    t = time.perf_counter()
    for i, h in enumerate(handles):
        dev.map(base + i * g, g, h)
    times["map"] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(n):
        dev.set_access(base + i * g, g)
    times["set_access"] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(n):
        dev.unmap(base + i * g, g)
    times["unmap"] = time.perf_counter() - t
    t = time.perf_counter()
    for h in handles:
        dev.release(h)
    times["release"] = time.perf_counter() - t
    dev.free_address(base, n * g)
    return {k: v / (1 if k == "reserve" else n) for k, v in times.items()}


def copies(nbytes):
    dev = vmalloc.HostDevice()
    h = dev.create(nbytes)
    p = dev.reserve(nbytes)
    dev.map(p, nbytes, h)
    dev.set_access(p, nbytes)
    pinned = dev.host_alloc(nbytes)
    ctypes.memset(pinned, 1, nbytes)  # commit the pages before timing
    pageable = ctypes.create_string_buffer(nbytes)
    dev.copy_to_device(p, pinned, nbytes)
    dev.synchronize()
    out = {}
    for name, fn in [
        ("HtoD pinned", lambda: dev.copy_to_device(p, pinned, nbytes)),
        ("HtoD pageable", lambda: dev.copy_to_device(p, ctypes.addressof(pageable), nbytes)),
        ("DtoH pinned", lambda: dev.copy_to_host(pinned, p, nbytes)),
        ("DtoD", lambda: dev.copy_device(p, p + nbytes // 2, nbytes // 2)),
    ]:
        t = time.perf_counter()
        fn()
        dev.synchronize()
        elapsed = time.perf_counter() - t
        moved = nbytes // 2 if name == "DtoD" else nbytes
        out[name] = moved / elapsed
    dev.host_free(pinned)
    return out


def fastest(fn, runs=3):
    """Per-key minimum over runs of fn() (seconds per call)."""
    results = [fn() for _ in range(runs)]
    return {k: min(r[k] for r in results) for k in results[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=2000)
    args = parser.parse_args()
    for backed in (True, False):
        r = fastest(lambda: calls(backed, args.chunks))
        print(f"{'backed' if backed else 'unbacked':9s}" +
              "".join(f"  {k} {v * 1e6:7.2f} us" for k, v in r.items()))
    results = [copies(256 * MiB) for _ in range(3)]
    for k in results[0]:
        print(f"{k:14s} {max(r[k] for r in results) / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
