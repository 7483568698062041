"""Throughput of the trace readers and of LoggingAllocator, for docs/benchmarks.md.

    PYTHONPATH=build/<name>/python python benchmarks/trace_readers.py [--events N]

Synthetic traces of N events (default 1,000,000) are written in each format to a temporary
directory, then read with open_trace(...).scan(); the shared PyTorch snapshot is read too when
shared/ is beside the repository. Reports the best of 3 runs.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import vmalloc
from vmalloc.traces import EVENT_DTYPE, VmtraceWriter, open_trace

SNAPSHOT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "torch_snapshot_transformer_lm.pickle"


def synthetic(n, seed=0):
    """n events: allocations of lognormal sizes, each freed a random number of steps later."""
    rng = np.random.default_rng(seed)
    pairs = n // 2
    sizes = np.minimum(rng.lognormal(12, 3, pairs).astype(np.uint64) + 1, 1 << 34)
    lifetimes = rng.integers(1, 200, pairs)
    order = np.concatenate([np.arange(pairs) * 2.0, np.arange(pairs) * 2.0 + lifetimes * 2 + 1])
    ops = np.concatenate([np.zeros(pairs, np.uint8), np.ones(pairs, np.uint8)])
    ids = np.concatenate([np.arange(pairs), np.arange(pairs)])
    idx = np.argsort(order, kind="stable")
    batch = np.zeros(2 * pairs, dtype=EVENT_DTYPE)
    batch["op"] = ops[idx]
    batch["addr"] = 0x7F0000000000 + ids[idx].astype(np.uint64) * 4096
    batch["size"] = sizes[ids[idx]]
    return batch


def best(fn, runs=3):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def write_formats(batch, tmp):
    paths = {}
    for encoding in ("raw", "zlib"):
        p = os.path.join(tmp, f"t.{encoding}.vmtrace")
        with VmtraceWriter(p, encoding=encoding, consistent=True) as w:
            w.write(batch)
        paths[f"vmtrace ({encoding})"] = (p, {})
    rmm = os.path.join(tmp, "t.csv")
    with open(rmm, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        for op, _, addr, size in batch.tolist():
            f.write(f"1,10:00:00.000000,{'allocate' if op == 0 else 'free'},{addr:#x},{size},0x0\n")
    paths["rmm_csv"] = (rmm, {})
    kineto = os.path.join(tmp, "t.json")
    with open(kineto, "w") as f:
        f.write('{"schemaVersion": 1, "traceEvents": [\n')
        for i, (op, _, addr, size) in enumerate(batch.tolist()):
            event = {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                     "pid": 1, "tid": 1, "ts": i, "args": {"Total Reserved": 0,
                     "Total Allocated": 0, "Bytes": size if op == 0 else -size,
                     "Device Id": 0, "Device Type": 1, "Addr": addr}}
            f.write(("," if i else "") + json.dumps(event, indent=1) + "\n")
        f.write("]}\n")
    paths["kineto"] = (kineto, {})
    return paths


def logging_overhead(calls=200_000):
    device = vmalloc.HostDevice(backed=False)
    plain = vmalloc.CachingAllocator(device)

    def loop(allocator):
        allocate, deallocate = allocator.allocate, allocator.deallocate
        for _ in range(calls):
            deallocate(allocate(4096))

    with tempfile.TemporaryDirectory() as tmp:
        t_plain, _ = best(lambda: loop(plain))
        log = vmalloc.LoggingAllocator(vmalloc.CachingAllocator(device), os.path.join(tmp, "l.vmtrace"))
        t_log, _ = best(lambda: loop(log))
        log.close()
    return t_plain / calls * 1e6, t_log / calls * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    batch = synthetic(args.events)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, (path, options) in write_formats(batch, tmp).items():
            seconds, info = best(lambda: open_trace(path, **options).scan())
            assert info.events == len(batch), (name, info.events)
            rows.append((name, len(batch), os.path.getsize(path), seconds))
        if SNAPSHOT.exists():
            seconds, info = best(lambda: open_trace(SNAPSHOT).scan())
            rows.append(("torch_snapshot (shared, 6,486 entries)", info.events, SNAPSHOT.stat().st_size, seconds))
    print(f"{'format':40} {'events':>10} {'file MB':>9} {'seconds':>8} {'M events/s':>11}")
    for name, events, size, seconds in rows:
        print(f"{name:40} {events:>10,} {size / 1e6:>9.1f} {seconds:>8.3f} {events / seconds / 1e6:>11.2f}")
    plain, logged = logging_overhead()
    print(f"\nallocate+deallocate from Python: CachingAllocator {plain:.2f} us, "
          f"LoggingAllocator over it {logged:.2f} us")


if __name__ == "__main__":
    main()
