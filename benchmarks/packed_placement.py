"""Packed placement against chunk placement and the caching allocator: utilization, smallest
device, and driver calls of repeated patterns (docs/benchmarks.md, "Packed placement").

    PYTHONPATH=build/<name>/python python -P benchmarks/packed_placement.py [SNAPSHOT]

SNAPSHOT defaults to ../shared/traces/torch_snapshot_transformer_lm.pickle (skipped if
absent). Deterministic: no timing, the figures change only with the allocators' code.
"""

import sys
from pathlib import Path

import numpy as np

import vmalloc
from vmalloc.bench import training_layers, training_step
from vmalloc.replay import min_capacity, replay_once
from vmalloc.traces import builtin_traces, open_trace

MiB = 1 << 20

ALLOCATORS = {
    "caching": "caching",
    "virtual (chunks)": "virtual",
    "packed (steal first)": lambda d: vmalloc.VirtualAllocator(d, placement="packed"),
    "packed (remap_slack 1/16)": lambda d: vmalloc.VirtualAllocator(
        d, placement="packed", remap_slack=1 / 16),
    "packed (create first)": lambda d: vmalloc.VirtualAllocator(
        d, placement="packed", steal_before_create=False),
}


def traces():
    yield "built-in transformer_lm_cpu", builtin_traces()["transformer_lm_cpu"], "drop"
    snapshot = Path(sys.argv[1] if len(sys.argv) > 1 else
                    Path(__file__).resolve().parents[2] / "shared" / "traces" /
                    "torch_snapshot_transformer_lm.pickle")
    if snapshot.exists():
        yield "snapshot (window)", str(snapshot), "drop"
        yield "snapshot (--before-window live)", str(snapshot), "live"


def utilization_table():
    print("trace / allocator                       peak req   peak res  util.  min capacity"
          "  util.  mm calls")
    for label, path, before in traces():
        print(label)
        for name, kind in ALLOCATORS.items():
            r = replay_once(path, kind, before_window=before)
            cap, exact, _ = min_capacity(path, kind, before_window=before, reference=r)
            print(f"  {name:<36} {r.peak_requested_bytes / MiB:8.1f} M "
                  f"{r.peak_reserved_bytes / MiB:8.1f} M  {r.utilization:.3f}  {cap / MiB:10.1f} M{'' if exact else '?'}"
                  f"  {r.peak_requested_bytes / cap:.3f}  {r.memory_management_calls:8,}")


def repeated_trace():
    print("\nbuilt-in trace replayed back to back: memory-management calls in total")
    events = open_trace(builtin_traces()["transformer_lm_cpu"]).events()
    for name, kind in ALLOCATORS.items():
        calls = [replay_once(np.tile(events, n), kind).memory_management_calls for n in (1, 2, 4)]
        print(f"  {name:<24} x1 {calls[0]:6,}  x2 {calls[1]:6,}  x4 {calls[2]:6,}"
              f"  (per extra repetition: {(calls[2] - calls[0]) / 3:,.0f})")


def training_pattern(steps=6):
    print(f"\nvmalloc bench's training-like step (48 layers): memory-management calls in each "
          f"of {steps} steps; host waits and modeled driver time in the last")
    sizes = training_layers(48)
    for name, kind in ALLOCATORS.items():
        dev = vmalloc.HostDevice(backed=False)
        a = (vmalloc.CachingAllocator(dev) if kind == "caching" else
             vmalloc.VirtualAllocator(dev) if kind == "virtual" else kind(dev))
        params = [a.allocate(n) for n in sizes]
        calls = []
        for _ in range(steps):
            before = dev.counters()
            training_step(a, sizes)
            after = dev.counters()
            calls.append(after["memory_management_calls"] - before["memory_management_calls"])
        syncs = after["event_synchronize"] - before["event_synchronize"]
        s = a.stats()
        print(f"  {name:<24} {' '.join(f'{c:3}' for c in calls)}  host waits {syncs}  modeled "
              f"{(after['modeled_seconds'] - before['modeled_seconds']) * 1e3:6.3f} ms"
              f"  utilization {s.peak_requested_bytes / s.peak_reserved_bytes:.3f}")
        for p, n in zip(params, sizes):
            a.deallocate(p, n)


if __name__ == "__main__":
    utilization_table()
    repeated_trace()
    training_pattern()
