"""Compressed swaps (opt-in): float32 activations swapped as fp16 or bf16, half the bytes on
the link, at the price of a small, measured deviation of the losses.

    python examples/offload_compression.py

A NumPy MLP trains on the emulated device, in core and then out of core under a 3 MiB budget
(about a quarter of its in-core peak; only its activations are compressed, and at 4 MiB those
are pre-activations whose sign alone is read back: no deviation at all): lossless (bit-identical), then with ``compress="fp16"``
and ``compress="bf16"``. Each run prints the bytes swapped out and how far its losses and
final weights are from the in-core run's.
"""

import vmalloc
from vmalloc.frameworks import numpy_training
from vmalloc.offload.runtime import Runtime

MiB = 1 << 20
NET = dict(network="mlp", batch=256, sizes=(512, 512, 512, 10), lr=0.01)
STEPS = 10


def runtime(budget, compress=None):
    dev = vmalloc.HostDevice(capacity="32MiB", granularity="2MiB")
    return Runtime(vmalloc.VirtualAllocator(dev, chunk_size="2MiB"), budget=budget,
                   scheduler="window" if budget else "none", compress=compress)


def main():
    ref = numpy_training.train(runtime(None), steps=STEPS, **NET)
    print(f"in core: losses {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f}")
    lossless_bytes = None
    for compress in (None, "fp16", "bf16"):
        out = numpy_training.train(runtime(3 * MiB, compress), steps=STEPS, **NET)
        s = out.stats
        d = numpy_training.deviation(ref, out)
        if compress is None:
            # Lossless is the default: the same bits as in core.
            assert out.losses == ref.losses and out.weights == ref.weights
            lossless_bytes = s["swapped_out_bytes"]
        else:
            assert s["compressed_swap_outs"] > 0
            assert s["swapped_out_bytes"] < lossless_bytes
            assert d["max_rel"] < 1e-3, d
        print(f"{compress or 'lossless':8s}: {s['swapped_out_bytes'] / MiB:6.1f} MiB out "
              f"({s['compressed_swap_outs']} swap-outs compressed), peak "
              f"{s['peak_device_bytes'] / MiB:.1f} MiB; losses off by at most "
              f"{d['max_abs']:.2g} ({d['max_rel']:.2g} relative), weights by "
              f"{d['weight_max_abs']:.2g}")


if __name__ == "__main__":
    main()
