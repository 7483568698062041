"""The default virtual allocator kind against the other placements: utilization on every real
trace the project has and the stress patterns, and memory-management driver calls per
repetition of each once warm (docs/benchmarks.md, "The default virtual allocator kind").

    PYTHONPATH=build/<name>/python python -P benchmarks/default_virtual.py [SNAPSHOT]

SNAPSHOT defaults to ../shared/traces/torch_snapshot_transformer_lm.pickle (skipped if absent).

Each trace is replayed 1, 2 and 3 times back to back (every repetition with addresses of its
own, everything of a repetition freed before the next for the window traces and stress
patterns); "calls in rep 2 / rep 3" are the memory-management calls the second and third
repetitions added: 0 / 0 is a zero-call steady state. The snapshot window ends with memory
live: every repetition frees it at its end (so does the single pass, which changes nothing
of its peaks). Deterministic: no timing.
"""

import sys
from pathlib import Path

import numpy as np

import vmalloc
from vmalloc import allocator_kinds
from vmalloc.replay import stress
from vmalloc.replay import replay_once
from vmalloc.traces import builtin_traces, open_trace
from vmalloc.traces.events import ALLOC, EVENT_DTYPE, FREE

MiB = 1 << 20

KINDS = {
    "virtual (this build's default)": "virtual",
    "chunks": lambda d: vmalloc.VirtualAllocator(d, placement="chunks"),
    "packed, steal first": lambda d: vmalloc.VirtualAllocator(d, placement="packed",
                                                              remap_slack=0.0),
    "packed, remap_slack 1/16": lambda d: vmalloc.VirtualAllocator(
        d, placement="packed", remap_slack=1 / 16),
    "packed, create first": lambda d: vmalloc.VirtualAllocator(
        d, placement="packed", steal_before_create=False),
}


def closed(events):
    """``events`` followed by a free of every allocation still live at its end (a window of a
    snapshot ends with memory live), so that a repetition starts from nothing live."""
    events = np.asarray(events)
    live = {}
    for op, stream, addr, size in events[["op", "stream", "addr", "size"]].tolist():
        if op == ALLOC:
            live[addr] = (stream, size)
        elif op == FREE:
            live.pop(addr, None)
    tail = np.zeros(len(live), dtype=EVENT_DTYPE)
    for i, (addr, (stream, size)) in enumerate(live.items()):
        tail[i] = (FREE, stream, addr, size)
    return np.concatenate([events, tail])


def tiled(events, n):
    """``events`` n times back to back, each repetition at addresses of its own."""
    events = closed(events)
    if n == 1 or not len(events):
        return events
    lo, hi = int(events["addr"].min()), int(events["addr"].max())
    out = np.tile(events, n)
    out["addr"] -= np.uint64(lo)
    out["addr"] += np.uint64(1 << 40)
    out["addr"] += np.repeat(np.arange(n, dtype=np.uint64) * np.uint64(hi - lo + 4096),
                             len(events))
    return out


def workloads(snapshot):
    yield "built-in transformer_lm_cpu", open_trace(
        builtin_traces()["transformer_lm_cpu"]).events(), True
    if snapshot.exists():
        yield "snapshot (window)", open_trace(str(snapshot), before_window="drop").events(), True
        # Pre-window memory stays live for good: utilization of one pass only.
        yield "snapshot (--before-window live)", open_trace(
            str(snapshot), before_window="live").events(), False
    for name in stress.PATTERNS:
        yield f"stress {name}", stress.generate(name), True


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = Path("traces") / "torch_snapshot_transformer_lm.pickle"
    root = Path(__file__).resolve().parents[1]
    # ../shared beside the repository, or beside the worktrees' parent.
    found = [p / name for p in (root.parent / "shared", root.parents[1] / "shared")
             if (p / name).exists()]
    snapshot = Path(args[0]) if args else (found[0] if found else Path(name))
    print(f"default kind 'virtual' = VirtualAllocator with "
          f"{dict(allocator_kinds.get('virtual').fixed)}")
    print(f"{'workload / allocator':<44} {'util.':>6} {'peak res':>10} {'mm calls':>9} "
          f"{'rep 2':>6} {'rep 3':>6}")
    for label, events, repeat in workloads(snapshot):
        print(label)
        for name, kind in KINDS.items():
            r1 = replay_once(closed(events) if repeat else events, kind, timeline_points=0)
            extra = ""
            if repeat:
                c2 = replay_once(tiled(events, 2), kind, timeline_points=0)
                c3 = replay_once(tiled(events, 3), kind, timeline_points=0)
                extra = (f" {c2.memory_management_calls - r1.memory_management_calls:6,} "
                         f"{c3.memory_management_calls - c2.memory_management_calls:6,}")
            print(f"  {name:<42} {r1.utilization:6.3f} {r1.peak_reserved_bytes / MiB:8.1f} M "
                  f"{r1.memory_management_calls:9,}{extra}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
