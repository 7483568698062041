"""Recompute instead of swap, executed: a NumPy MLP trains on the emulated device under half of
its in-core memory, first swapping only, then with ``Runtime(recompute=True)``, which drops
activations (their chunks unmapped, no copy) and re-runs the functions that wrote them before
they are read again. Both runs are bit-identical to in-core training; the second moves fewer
bytes.

    python examples/runtime_recompute.py
"""

import vmalloc
from vmalloc.offload import Runtime
from vmalloc.frameworks.numpy_training import train
from vmalloc.sizes import format_size

NET = dict(network="mlp", batch=8192, sizes=(128,) * 10 + (10,), steps=3)


def runtime(capacity, recompute=False, scheduler="window"):
    dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB", small_threshold=64 << 10)
    return Runtime(alloc, scheduler=scheduler, recompute=recompute)


def main():
    ref = train(runtime("1GiB", scheduler="none"), **NET)
    capacity = ref.stats["peak_device_bytes"] // 2 // (2 << 20) * (2 << 20)
    print(f"in-core peak {format_size(ref.stats['peak_device_bytes'])}; "
          f"device of {format_size(capacity)}")
    for recompute in (False, True):
        rt = runtime(capacity, recompute)
        out = train(rt, **NET)
        st = out.stats
        same = out.losses == ref.losses and out.weights == ref.weights
        print(f"recompute={recompute!s:<5}  bit-identical: {same}  swapped out "
              f"{format_size(st['swapped_out_bytes'])}  recomputed functions "
              f"{st['recomputed_functions']} (buffers dropped {st['recompute_drops']})")
        assert same
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
