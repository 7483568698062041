"""What vmalloc.torch.out_of_core adds to a PyTorch training step on CPU (issue 21's baseline).

A 12-layer ``nn.TransformerEncoder`` (d_model 64, 4 heads, feed-forward 256, batch 4, sequence
32, SGD), the poison backend: the steady-state step time plain, inside ``out_of_core`` with no
budget (nothing to swap), with an ample budget (room: nothing swaps, but every op is predicted
on meta today) and under half of the in-core peak; each as a ratio to plain PyTorch measured in
the same process, with the aten ops per step and the microseconds added per op.

    PYTHONPATH=build/NAME/python python -P benchmarks/torch_step_overhead.py [--steps N]
        [--layers L]

Report ``python -m timeit pass`` beside the figures: this machine's speed varies about 4x.
"""

import argparse
import time
import warnings

import torch

import vmalloc.torch as vtorch


def model_and_data(layers):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    return model, opt, torch.randn(4, 32, 64, generator=g)


def step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def aten_ops_per_step(model, opt, x):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        step(model, opt, x)
    return Count.n


def timed_steps(model, opt, x, steps, warm=3):
    for _ in range(warm):             # recording and the first followed iterations
        step(model, opt, x)
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x)
    return (time.perf_counter() - start) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    model, opt, x = model_and_data(args.layers)
    ops = aten_ops_per_step(model, opt, x)
    plain = timed_steps(model, opt, x, args.steps)
    model, opt, x = model_and_data(args.layers)
    with vtorch.out_of_core(budget=None, backend="poison", device="cpu") as ooc:
        none = timed_steps(model, opt, x, args.steps)
    peak = ooc.stats()["peak_device_bytes"]
    rows = [("plain PyTorch", plain, None), ("out_of_core, budget=None", none, ooc.stats())]
    for label, budget in (("out_of_core, ample budget (64 GiB)", "64GiB"),
                          ("out_of_core, half the in-core peak", max(peak // 2, 1))):
        model, opt, x = model_and_data(args.layers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with vtorch.out_of_core(budget=budget, backend="poison", device="cpu") as ooc:
                t = timed_steps(model, opt, x, args.steps)
        rows.append((label, t, ooc.stats()))
    print(f"{args.layers}-layer TransformerEncoder, {ops} aten ops per step, "
          f"in-core peak of tracked storages {peak} bytes, {args.steps} steps after 3 warm-up")
    for label, t, stats in rows:
        extra = "" if stats is None else (
            f"  swapped out {stats['swapped_out_bytes']} B, "
            f"scheduled iterations {stats['scheduled_iterations']}")
        print(f"{label:38s} {t * 1e3:9.1f} ms/step  {t / plain:5.2f}x  "
              f"+{(t - plain) / ops * 1e6:7.1f} us/op{extra}")


if __name__ == "__main__":
    main()
