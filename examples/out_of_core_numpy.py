"""Out-of-core training for real, on the emulated device: a NumPy MLP whose every tensor lives
in vmalloc memory trains under half of its in-core memory, bit-identically.

    python examples/out_of_core_numpy.py [--network mlp|cnn] [--steps N]
"""

import argparse
import time

import vmalloc
from vmalloc.offload import numpy_training as nt
from vmalloc.offload.runtime import Runtime
from vmalloc.sizes import format_size

CONFIGS = {
    "mlp": dict(network="mlp", batch=4096, sizes=(1024, 1024, 1024, 10), lr=0.01),
    "cnn": dict(network="cnn", batch=32, channels=(3, 16, 16, 16, 16, 16, 32), size=16,
                lr=0.01),
}


def run(capacity, config, steps, scheduler="window"):
    device = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
    rt = Runtime(vmalloc.VirtualAllocator(device, chunk_size="2MiB"), scheduler=scheduler)
    start = time.perf_counter()
    result = nt.train(rt, steps=steps, **config)
    return result, rt, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=sorted(CONFIGS), default="mlp")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    config = CONFIGS[args.network]

    ref, ref_rt, ref_s = run("4GiB", config, args.steps, scheduler="none")
    peak = ref_rt.stats()["peak_device_bytes"]
    capacity = (peak // 2) // (2 << 20) * (2 << 20)
    out, rt, out_s = run(capacity, config, args.steps)
    stats = rt.stats()

    print(f"{args.network}: in-core peak {format_size(peak)}; out of core on a device of "
          f"{format_size(capacity)} (budget {format_size(rt.budget)})")
    print(f"  losses in core     {[round(x, 6) for x in ref.losses]}  ({ref_s:.2f} s)")
    print(f"  losses out of core {[round(x, 6) for x in out.losses]}  ({out_s:.2f} s)")
    identical = out.losses == ref.losses and out.weights == ref.weights
    print(f"  losses and weights bit-identical: {identical}")
    print(f"  peak device bytes {format_size(stats['peak_device_bytes'])}, swapped out "
          f"{format_size(stats['swapped_out_bytes'])}, swapped in "
          f"{format_size(stats['swapped_in_bytes'])}")
    print(f"  iterations {stats['iterations']} (recorded {stats['recorded_iterations']}, "
          f"scheduled {stats['scheduled_iterations']}), scheduled swap-outs "
          f"{stats['scheduled_swap_outs']}, swap-ins {stats['scheduled_swap_ins']}, on demand "
          f"{stats['on_demand_swap_ins']}")
    if not identical:
        raise SystemExit("out-of-core training differs from in-core training")


if __name__ == "__main__":
    main()
