"""The loss curve's deviation from the lossless run when activations are swapped compressed
(issue 16 item 3): 100 steps of small models, out of core, lossless, fp16 and bf16.

    python benchmarks/compression_deviation.py [--steps 100] [--only numpy-cnn,numpy-mlp,torch]

- ``numpy-cnn``, ``numpy-mlp``: the NumPy training of :mod:`vmalloc.frameworks.numpy_training`
  on the emulated device (SwapManager backend, window scheduler) at half the in-core peak.
- ``torch``: an MLP under ``vmalloc.torch.out_of_core`` with the poison backend (CPU tensors).

For each: the lossless out-of-core run (checked bit-identical to in core), then fp16 and bf16:
max and mean absolute / relative loss deviation over the steps, the final weights' largest
absolute and relative deviation, and the bytes swapped out. Prints a Markdown table and the
JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time



def numpy_runs(network, steps, config):
    import vmalloc
    from vmalloc.frameworks import numpy_training as nt
    from vmalloc.offload.runtime import Runtime

    def make(capacity, scheduler, compress=None):
        dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
        return Runtime(vmalloc.VirtualAllocator(dev, chunk_size="2MiB"), scheduler=scheduler,
                       compress=compress)

    rt = make("4GiB", "none")
    ref = nt.train(rt, steps=steps, **config)
    capacity = rt.stats()["peak_device_bytes"] // 2 // (2 << 20) * (2 << 20)
    rows = []
    for compress in (None, "fp16", "bf16"):
        t0 = time.perf_counter()
        out = nt.train(make(capacity, "window", compress), steps=steps, **config)
        rows.append(row(f"numpy-{network}", compress, ref, out, time.perf_counter() - t0,
                        out.stats))
    return rows


def torch_runs(steps, batch=256, width=512, budget="4MiB"):
    import torch

    import vmalloc.torch as vtorch
    from vmalloc.frameworks.numpy_training import TrainResult

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, 10))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    # one tensor per step (views of one big tensor would make every step read all of it)
    xs = [torch.randn(batch, 256, generator=g) for _ in range(steps)]
    ys = [x[:, :10].argmax(dim=1) for x in xs]      # a learnable rule: the losses fall

    def train(ctx):
        model, opt = make()
        losses = []
        with ctx as ooc:
            for i in range(steps):
                loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        weights = [p.detach().numpy().tobytes() for p in model.parameters()]
        return TrainResult(losses, weights, ooc.stats() if ooc is not None else {})

    import contextlib
    ref = train(contextlib.nullcontext())
    rows = []
    for compress in (None, "fp16", "bf16"):
        t0 = time.perf_counter()
        out = train(vtorch.out_of_core(budget=budget, backend="poison", device="cpu",
                                       compress=compress))
        rows.append(row("torch-mlp", compress, ref, out, time.perf_counter() - t0, out.stats))
    return rows


def row(model, compress, ref, out, seconds, stats):
    from vmalloc.frameworks.numpy_training import deviation

    d = deviation(ref, out)
    return dict(model=model, compress=compress or "lossless", steps=len(out.losses),
                identical=out.losses == ref.losses and out.weights == ref.weights,
                first_loss=ref.losses[0], last_loss=ref.losses[-1], **d,
                swapped_out_bytes=stats.get("swapped_out_bytes", 0),
                compressed_swap_outs=stats.get("compressed_swap_outs", 0),
                seconds=round(seconds, 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--only", default="numpy-cnn,numpy-mlp,torch")
    args = p.parse_args(argv)
    from vmalloc.frameworks.numpy_training import CONFIGS

    which = args.only.split(",")
    rows = []
    if "numpy-cnn" in which:
        rows += numpy_runs("cnn", args.steps, CONFIGS["cnn"])
    if "numpy-mlp" in which:
        # CONFIGS["mlp"] at a quarter of its batch: 100 steps in minutes, not tens of them
        rows += numpy_runs("mlp", args.steps, dict(CONFIGS["mlp"], batch=1024))
    if "torch" in which:
        rows += torch_runs(args.steps)
    print("| model | swaps | loss max abs | loss mean abs | loss max rel | loss mean rel "
          "| weights max abs | weights max rel | MiB out | compressed swap-outs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['compress']}{' (bit-identical)' if r['identical'] else ''} "
              f"| {r['max_abs']:.3g} | {r['mean_abs']:.3g} | {r['max_rel']:.3g} "
              f"| {r['mean_rel']:.3g} | {r['weight_max_abs']:.3g} | {r['weight_max_rel']:.3g} "
              f"| {r['swapped_out_bytes'] / 2 ** 20:.1f} | {r['compressed_swap_outs']} |")
    print(json.dumps(rows, indent=1, default=float))
    bad = [r for r in rows if r["compress"] == "lossless" and not r["identical"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
