"""PyTorch users' habits without a GPU: vmalloc.torch.memory_summary() and a memory snapshot
that PyTorch's memory viewer (https://pytorch.org/memory_viz) opens, from vmalloc's own
allocator (through a LoggingAllocator) and from the trace shipped with vmalloc.

Run: python examples/torch_memory_snapshot.py [FOLDER]   (writes two .pickle files in FOLDER,
by default a temporary folder)
"""

import os
import sys
import tempfile

import vmalloc
import vmalloc.torch
from vmalloc.traces import builtin_traces, open_trace
from vmalloc.traces.torch_export import snapshot_from_trace, write_snapshot


def main(folder):
    device = vmalloc.HostDevice(capacity="1GiB", backed=False)   # CudaDevice(0) on a GPU
    with tempfile.TemporaryDirectory() as tmp:
        log = vmalloc.LoggingAllocator(vmalloc.VirtualAllocator(device),
                                       os.path.join(tmp, "job.vmtrace"))
        vmalloc.set_current_allocator(log, 0)
        try:
            weights = log.allocate("24MiB")
            for step in range(3):                     # activations come and go every step
                acts = [log.allocate(f"{n}MiB") for n in (8, 5, 3)]
                for p in reversed(acts):
                    log.deallocate(p)
            print(vmalloc.torch.memory_summary())
            path = write_snapshot(vmalloc.torch.memory_snapshot(),
                                  os.path.join(folder, "vmalloc_allocator.pickle"))
            history = open_trace(path).events()
            print(f"{path}: {len(history)} events read back (10 allocations, 9 frees)")
            assert len(history) == 19
            log.deallocate(weights)
        finally:
            vmalloc.set_current_allocator(None, 0)
            log.close()

    shipped = builtin_traces()["transformer_lm_cpu"]
    path = write_snapshot(snapshot_from_trace(shipped),
                          os.path.join(folder, "transformer_lm_cpu.pickle"))
    assert len(open_trace(path).events()) == len(open_trace(shipped).events())
    print(f"{path}: the shipped trace as a PyTorch snapshot; open it at "
          "https://pytorch.org/memory_viz")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
