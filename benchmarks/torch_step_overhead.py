"""What vmalloc.torch.out_of_core adds to a PyTorch training step on CPU (issue 21's baseline).

A 12-layer ``nn.TransformerEncoder`` (d_model 64, 4 heads, feed-forward 256, batch 4, sequence
32, SGD), the poison backend: the steady-state step time plain, inside ``out_of_core`` with no
budget (nothing to swap), with an ample budget (room: nothing swaps, but every op is predicted
on meta today) and under half of the in-core peak; each as a ratio to plain PyTorch measured in
the same process, with the aten ops per step and the microseconds added per op.

    PYTHONPATH=build/NAME/python python -P benchmarks/torch_step_overhead.py [--steps N]
        [--layers L] [--threads T]

Each row is timed right after a plain run of the same length (a fresh model), and each as the
median of its per-step times: the machine is shared and its load changes within seconds, so a
ratio is only taken between neighbours. ``--pairs N`` repeats each (plain, out_of_core) pair N
times and prints every ratio and their median; ``--clock cpu`` times with the process's CPU
time (``time.process_time``: what other processes on a loaded machine take is not counted). ``--threads`` (default 1): PyTorch's intra-op threads
(two threads on two shared cores made plain steps vary 20-fold). Report ``python -m timeit
pass`` beside the figures.

Issue 21 item 1: with nothing to swap the driver leaves the dispatcher after the probation
iteration (the third here: recording, recording again once the optimizer is seen, then the
probation), so ``budget=None`` and the ample budget run as plain PyTorch once warm; under half
the memory the probation's swaps are replayed at saved-tensor, module, gradient and
optimizer-step boundaries (item 1b, :mod:`vmalloc.frameworks.torch_pressure`).
"""

import argparse
import time
import warnings

import torch

import vmalloc.torch as vtorch
from vmalloc.frameworks.torch_ops import count_aten_ops


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
    return count_aten_ops(step, model, opt, x)


CLOCK = time.perf_counter


def timed_steps(model, opt, x, steps, warm=3):
    """The median seconds per step after ``warm`` steps (recording and the probation)."""
    import statistics
    for _ in range(warm):
        step(model, opt, x)
    times = []
    for _ in range(steps):
        start = CLOCK()
        step(model, opt, x)
        times.append(CLOCK() - start)
    return statistics.median(times)


def plain_steps(layers, steps):
    model, opt, x = model_and_data(layers)
    return timed_steps(model, opt, x, steps)


def main():
    import statistics
    global CLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    model, opt, x = model_and_data(args.layers)
    ops = aten_ops_per_step(model, opt, x)
    with vtorch.out_of_core(budget=None, backend="poison", device="cpu") as ooc:
        timed_steps(model, opt, x, 1)
    peak = ooc.stats()["peak_device_bytes"]
    rows = []
    for label, budget in (("out_of_core, budget=None", None),
                          ("out_of_core, ample budget (64 GiB)", "64GiB"),
                          ("out_of_core, half the in-core peak", max(peak // 2, 1))):
        pairs = []
        for _ in range(args.pairs):
            plain = plain_steps(args.layers, args.steps)
            model, opt, x = model_and_data(args.layers)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with vtorch.out_of_core(budget=budget, backend="poison", device="cpu") as ooc:
                    t = timed_steps(model, opt, x, args.steps)
            pairs.append((t, plain))
        rows.append((label, pairs, ooc.stats()))
    print(f"{args.layers}-layer TransformerEncoder, {ops} aten ops per step, "
          f"in-core peak of tracked storages {peak} bytes, median of {args.steps} steps "
          f"after 3 warm-up, {args.threads} thread(s), {args.clock} clock, "
          f"{args.pairs} pair(s) a row")
    for label, pairs, stats in rows:
        t, plain = pairs[-1]
        ratios = [a / b for a, b in pairs]
        extra = (f"  swapped out {stats['swapped_out_bytes']} B (+{stats['pressure_swap_outs']} "
                 f"steady swap-outs), steady iterations {stats.get('steady_iterations', 0)} of "
                 f"{stats['iterations']}, peak {stats['peak_device_bytes']} B")
        print(f"{label:38s} {t * 1e3:9.1f} ms/step (plain {plain * 1e3:6.1f})  "
              f"{t / plain:5.2f}x  +{(t - plain) / ops * 1e6:7.1f} us/op{extra}")
        if len(pairs) > 1:
            print(f"{'':38s} ratios {' '.join(f'{r:.2f}' for r in ratios)}, median "
                  f"{statistics.median(ratios):.2f}x, added per aten op median "
                  f"{statistics.median((a - b) / ops * 1e6 for a, b in pairs):.1f} us")


if __name__ == "__main__":
    main()
