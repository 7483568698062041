"""PageStream throughput: pages per second, bytes per second and the host-wait fraction on the
emulated device, measured, and the same figures predicted by the simulator's GPU models.

    PYTHONPATH=build/NAME/python python -P benchmarks/page_stream.py
        [--total-mib 64] [--page-kib 256 1024 4096] [--prefetch 0 1 2 4] [--passes 3]
        [--use sync|sum] [--model-total-gib 4] [--model-only]

Measured (``vmalloc.HostDevice``): pages held in memory, a device budget of exactly
``prefetch + 1`` pages so every page is streamed on every pass (nothing resident), one warm-up
pass, then ``--passes`` timed passes. The consumer either only makes the page's stream wait
for it (``sync``: the stream's own throughput) or also sums the page on the "device" with
NumPy (``sum``: a kernel that reads the page once). The host-wait fraction ("wait frac") is
``stats()["host_wait_seconds"]`` over the elapsed time: the consumer waited on the host for a
page still being read into staging; "sync frac" is the time in ``synchronize_stream``: the
consumer waited for the page's copy (the emulated device runs a stream's copies on its own
worker thread). Each row is the median of ``--repeat`` runs (by GB/s) with their range. ``python -m timeit pass`` is printed beside (the machine's
speed at the time).

Predicted (:func:`vmalloc.offload.pages.model.predict_scan`): one scan of
``--model-total-gib`` in pages of each size, copies at each GPU model's host-to-device
bandwidth, the consumer reading each page once at its HBM bandwidth; ``auto`` is the prefetch a
PageStream picks from the link. Timings are the emulated device's own: its "copies" are memcpy
on this machine, so they say what the stream's machinery costs, not what a GPU would do.
"""

import argparse
import ctypes
import time
import timeit
import warnings

import numpy as np

import vmalloc
from vmalloc import offload
from vmalloc.offload.hardware.gpus import GPUS
from vmalloc.offload.pages.model import predict_scan

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def timeit_pass():
    """``python -m timeit pass``'s figure: nanoseconds per loop, the best of 5."""
    number, _ = timeit.Timer("pass").autorange()
    return min(timeit.repeat("pass", number=number, repeat=5)) / number * 1e9


def measure(page_bytes, prefetch, total_bytes, passes, use):
    """One configuration on the emulated device: a dict of the figures."""
    cols = 1024                                  # 4 KiB float32 rows
    rows = max(1, page_bytes // (4 * cols))
    count = max(2, total_bytes // (rows * 4 * cols))
    rng = np.random.default_rng(0)
    pages = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(count)]
    budget = (prefetch + 1) * pages[0].nbytes
    dev = vmalloc.HostDevice(capacity=budget + 64 * MiB)
    manager = offload.SwapManager(vmalloc.VirtualAllocator(dev))
    sink, synced = 0.0, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a lowered prefetch would skew the row
        stream = offload.PageStream(pages, manager=manager, prefetch=prefetch, budget=budget)
    with stream:
        def one_pass():
            nonlocal sink, synced
            for page in stream:
                t = time.perf_counter()
                dev.synchronize_stream(stream.stream)    # the page is on the device
                synced += time.perf_counter() - t
                if use == "sum":
                    buf = (ctypes.c_char * page.nbytes).from_address(page.ptr)
                    sink += float(np.frombuffer(buf, dtype=np.float32).sum())
        one_pass()                               # warm-up: staging blocks, slot buffers
        before = stream.stats()
        synced = 0.0
        began = time.perf_counter()
        for _ in range(passes):
            one_pass()
        elapsed = time.perf_counter() - began
        after = stream.stats()
    served = after["pages_served"] - before["pages_served"]
    copied = after["bytes_copied"] - before["bytes_copied"]
    waited = after["host_wait_seconds"] - before["host_wait_seconds"]
    return dict(page_bytes=pages[0].nbytes, pages=count, prefetch=prefetch,
                pages_per_second=served / elapsed, bytes_per_second=copied / elapsed,
                wait_fraction=waited / elapsed, sync_fraction=synced / elapsed,
                host_waits=after["host_waits"] - before["host_waits"], served=served)


def size(n):
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=64)
    ap.add_argument("--page-kib", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row; the median is shown")
    ap.add_argument("--use", choices=("sync", "sum"), default="sync")
    ap.add_argument("--model-total-gib", type=float, default=4.0)
    ap.add_argument("--model-only", action="store_true")
    args = ap.parse_args()

    if not args.model_only:
        print(f"timeit pass: {timeit_pass():.2f} ns")
        print(f"emulated device, {args.total_mib} MiB a pass, {args.passes} passes, "
              f"consumer {args.use!r}, budget = (prefetch + 1) pages")
        print(f"{'page':>8} {'pages':>5} {'prefetch':>8} {'pages/s':>9} {'GB/s':>7} "
              f"{'GB/s range':>11} {'host waits':>10} {'wait frac':>9} {'sync frac':>9}")
        for kib in args.page_kib:
            for k in args.prefetch:
                runs = sorted((measure(kib * KiB, k, args.total_mib * MiB, args.passes,
                                       args.use) for _ in range(args.repeat)),
                              key=lambda r: r["bytes_per_second"])
                r = runs[len(runs) // 2]
                lo, hi = runs[0]["bytes_per_second"] / 1e9, runs[-1]["bytes_per_second"] / 1e9
                print(f"{size(r['page_bytes']):>8} {r['pages']:>5} {k:>8} "
                      f"{r['pages_per_second']:>9.0f} {r['bytes_per_second'] / 1e9:>7.2f} "
                      f"{lo:>5.2f}-{hi:<5.2f} {r['host_waits']:>4}/{r['served']:<5} "
                      f"{r['wait_fraction']:>9.3f} {r['sync_fraction']:>9.3f}")
        print(f"timeit pass: {timeit_pass():.2f} ns")

    total = int(args.model_total_gib * GiB)
    print(f"\nGPU models: one scan of {args.model_total_gib:g} GiB, consumer reads each page "
          "once at HBM bandwidth")
    print(f"{'gpu':>17} {'page':>7} {'prefetch':>8} {'pages/s':>9} {'GB/s':>7} "
          f"{'wait frac':>9}")
    for name in GPUS:
        for kib in args.page_kib + [32 * 1024]:
            page = kib * KiB
            for k in [None] + [p for p in args.prefetch if p in (0, 1)]:
                p = predict_scan(name, page, max(1, total // page), prefetch=k)
                label = f"{p.prefetch} auto" if k is None else str(k)
                print(f"{name:>17} {size(page):>7} {label:>8} {p.pages_per_second:>9.0f} "
                      f"{p.bytes_per_second / 1e9:>7.2f} {p.wait_fraction:>9.3f}")


if __name__ == "__main__":
    main()
