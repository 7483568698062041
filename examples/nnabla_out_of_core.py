"""Out-of-core training with nnabla, scheduled by vmalloc's window scheduler.

A 4-conv network trains for a few iterations three ways on CPU contexts (host CpuArray,
"device" CpuCachedArray): unscheduled, with nnabla's own SwapInOutScheduler, and with
vmalloc.nnabla.WindowSwapScheduler at the same budget. The losses are identical; the example
prints them, the bytes vmalloc's adapter moved per iteration and the time per iteration.

nnabla has wheels for Python 3.8-3.10 only: elsewhere (or without nnabla) the example says it
skipped and why, and exits 0. Make an environment with ``scripts/nnabla-env`` and run
``.venv-nnabla/bin/python examples/nnabla_out_of_core.py``.
"""

import contextlib
import sys
import time

try:
    import nnabla as nn
    import nnabla.functions as F
    import nnabla.parametric_functions as PF
    import nnabla.solvers as S
    from nnabla.lms import SwapInOutScheduler
except ImportError as e:
    print(f"skipped: nnabla is not available for Python {sys.version.split()[0]} ({e}); "
          "nnabla's wheels exist for Python 3.8-3.10 (scripts/nnabla-env makes such an "
          "environment)")
    sys.exit(0)

import numpy as np

from vmalloc.nnabla import WindowSwapScheduler

BUDGET = 800_000          # bytes: about 2/3 of the network's in-core peak
ITERATIONS = 8


def build():
    nn.clear_parameters()
    rng = np.random.RandomState(0)
    x = nn.Variable((8, 3, 16, 16))
    t = nn.Variable((8, 1))
    h = x
    for k in range(4):
        h = F.relu(PF.convolution(h, 16, (3, 3), pad=(1, 1), name=f"conv{k}", rng=rng))
    loss = F.mean(F.softmax_cross_entropy(PF.affine(h, 10, name="fc", rng=rng), t))
    solver = S.Momentum(0.01, 0.9)
    solver.set_parameters(nn.get_parameters())
    return x, t, loss, solver


def train(make_scheduler):
    host = nn.Context(["cpu:float"], "CpuArray", "0")
    device = nn.Context(["cpu:float"], "CpuCachedArray", "0")
    nn.set_default_context(device)
    x, t, loss, solver = build()
    sched = make_scheduler(host, device, solver) if make_scheduler else None
    losses, seconds = [], []
    for i in range(ITERATIONS):
        r = np.random.RandomState(1000 + i)
        start = time.perf_counter()
        with sched if sched is not None else contextlib.nullcontext():
            x.d = r.randn(*x.shape).astype(np.float32)
            t.d = r.randint(0, 10, size=t.shape)
            loss.forward(clear_no_need_grad=True)
            solver.zero_grad()
            loss.backward(clear_buffer=True)
            solver.update()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.d))
    return losses, seconds, sched


def main():
    base, t_base, _ = train(None)
    theirs, t_theirs, _ = train(lambda h, d, s: SwapInOutScheduler(h, d, BUDGET))
    ours, t_ours, sched = train(lambda h, d, s: WindowSwapScheduler(h, d, BUDGET, solver=s))
    print("losses (unscheduled):", [round(v, 6) for v in base])
    print("nnabla SwapInOutScheduler identical:", theirs == base)
    print("vmalloc WindowSwapScheduler identical:", ours == base)
    st = sched.stats()
    run = [h for h in sched.history if h["mode"] == "run"][-1]
    print(f"budget {BUDGET} bytes; in-core peak {st['in_core_peak_bytes']}; planned peak "
          f"{st['planned_peak_bytes']}")
    print(f"vmalloc per scheduled iteration: {run['swap_in_bytes']} bytes in, "
          f"{run['swap_out_bytes']} bytes out")
    ms = lambda s: 1000 * float(np.median(s[2:]))  # noqa: E731 - after the record
    print(f"median ms per iteration: unscheduled {ms(t_base):.2f}, nnabla {ms(t_theirs):.2f}, "
          f"vmalloc {ms(t_ours):.2f}")
    print(sched.schedule.describe(sched.sequence, limit=8))
    return 0 if theirs == base and ours == base else 1


if __name__ == "__main__":
    sys.exit(main())
