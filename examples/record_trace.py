"""Record an allocator session to a trace, read it back, and look at the shipped trace.

A LoggingAllocator wraps any vmalloc allocator and writes every allocation and free to a
.vmtrace file; the same file then replays through other allocators (`vmalloc replay
session.vmtrace`). Runs on the emulated device: no GPU needed.

Run: python examples/record_trace.py
"""

import os
import tempfile

import numpy as np

import vmalloc
from vmalloc.traces import ALLOC, builtin_traces, open_trace

MiB = 1 << 20


def record(path):
    """A toy training loop's allocation pattern: weights stay, activations come and go."""
    device = vmalloc.HostDevice(capacity="1GiB", backed=False)  # accounting only
    with vmalloc.LoggingAllocator(vmalloc.CachingAllocator(device), path) as log:
        weights = [log.allocate(s * MiB) for s in (4, 4, 16)]
        for step in range(3):
            activations = [log.allocate((step + i + 1) * MiB) for i in range(5)]
            for p in reversed(activations):
                log.deallocate(p)
        for p in weights:
            log.deallocate(p)
        print(f"recorded {log.events_written} events with {log.name}")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "session.vmtrace")
        record(path)
        trace = open_trace(path)
        events = trace.events()
        info = trace.info
        print(f"read back: {info.allocs} allocs, {info.frees} frees, "
              f"live peak {vmalloc.format_size(info.peak_live_bytes)}")
        # Weights (24 MiB) + the last step's activations (3 + 4 + 5 + 6 + 7 MiB).
        assert info.allocs == 18 and info.peak_live_bytes == (24 + 25) * MiB
        sizes = events["size"][events["op"] == ALLOC]
        print("request sizes (MiB):", (sizes // MiB).tolist())

    name, builtin = next(iter(builtin_traces().items()))
    info = open_trace(builtin).scan()
    print(f"\nshipped trace {name!r}: {info.events} events, largest request "
          f"{vmalloc.format_size(info.largest_alloc_bytes)}, live peak "
          f"{vmalloc.format_size(info.peak_live_bytes)} "
          f"(recorded from {info.metadata['source_format']})")
    events = open_trace(builtin).events()
    sizes = events["size"][events["op"] == ALLOC]
    classes = np.bincount(np.log2(sizes).astype(int))
    print("requests per size class:", {f"<2^{k + 1}": int(n) for k, n in enumerate(classes) if n})


if __name__ == "__main__":
    main()
