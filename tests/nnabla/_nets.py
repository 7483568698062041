"""A small 4-conv network trained for a few iterations, shared by the nnabla tests and the
subprocess that runs nnabla's own scheduler (importable without pytest)."""

import numpy as np

HOST = ("cpu:float", "CpuArray", "0")
DEVICE = ("cpu:float", "CpuCachedArray", "0")


def contexts():
    import nnabla as nn
    host = nn.Context([HOST[0]], HOST[1], HOST[2])
    device = nn.Context([DEVICE[0]], DEVICE[1], DEVICE[2])
    return host, device


def build(batch=8, channels=16, size=16, seed=0):
    """(x, t, mid, loss, solver, feed): a 4-conv classifier (conv-relu x 4, affine, softmax
    cross entropy, Momentum); ``mid`` is the output of the second conv block; ``feed(i)`` sets
    batch i's data."""
    import nnabla as nn
    import nnabla.functions as F
    import nnabla.parametric_functions as PF
    import nnabla.solvers as S

    nn.clear_parameters()
    rng = np.random.RandomState(seed)
    x = nn.Variable((batch, 3, size, size))
    t = nn.Variable((batch, 1))
    h = x
    mid = None
    for k in range(4):
        h = F.relu(PF.convolution(h, channels, (3, 3), pad=(1, 1), name=f"conv{k}", rng=rng))
        if k == 1:
            mid = h
    y = PF.affine(h, 10, name="fc", rng=rng)
    loss = F.mean(F.softmax_cross_entropy(y, t))
    solver = S.Momentum(0.01, 0.9)
    solver.set_parameters(nn.get_parameters())

    def feed(i):
        r = np.random.RandomState(1000 + i)
        x.d = r.randn(*x.shape).astype(np.float32)
        t.d = r.randint(0, 10, size=t.shape)

    return x, t, mid, loss, solver, feed


def longer(loss):
    """The loss through two more functions that change nothing (+0.0, x1.0): the same values,
    an iteration two functions longer (four with their backward)."""
    import nnabla.functions as F
    return F.mul_scalar(F.add_scalar(loss, 0.0), 1.0)


def step(loss, solver, feed, i, first=None, tail=None):
    """One training step; ``first`` (a variable of the graph) is computed first, so the
    functions up to it run twice in another order than recorded; ``tail`` is computed after
    the update (functions after the end of a normal iteration)."""
    feed(i)
    if first is not None:
        first.forward()
    loss.forward(clear_no_need_grad=True)
    solver.zero_grad()
    loss.backward(clear_buffer=True)
    solver.update()
    value = float(loss.d)
    if tail is not None:
        tail.forward()
    return value


def train(iterations=5, scheduler=None, kinds=None, seed=0, **kw):
    """Losses of ``iterations`` steps. ``scheduler(host_ctx, device_ctx, solver)`` (None:
    unscheduled) makes the scheduler that wraps each step as ``with sched:``. ``kinds`` maps an
    iteration to "longer" (the loss through two more functions) or "reordered" (an
    intermediate computed first) or "tail" (one function after the update, on a copy of the loss:
    recorded first, it makes the normal iterations shorter than the record; later, longer); the
    losses are the same whatever the kinds. Returns (losses, sched)."""
    import nnabla as nn
    host, device = contexts()
    nn.set_default_context(device)
    x, t, mid, loss, solver, feed = build(seed=seed, **kw)
    loss2 = longer(loss)
    import nnabla.functions as F
    probe = F.add_scalar(loss.get_unlinked_variable(), 0.0)
    kinds = kinds or {}
    sched = None if scheduler is None else scheduler(host, device, solver)
    losses = []
    for i in range(iterations):
        kind = kinds.get(i, "normal")
        cur = loss2 if kind == "longer" else loss
        first = mid if kind == "reordered" else None
        tail = probe if kind == "tail" else None
        if sched is None:
            losses.append(step(cur, solver, feed, i, first, tail))
        else:
            with sched:
                losses.append(step(cur, solver, feed, i, first, tail))
    return losses, sched


def nnabla_scheduler(budget):
    """nnabla's own SwapInOutScheduler at ``budget`` bytes, as a train() scheduler."""
    def make(host, device, solver):
        from nnabla.lms import SwapInOutScheduler
        return SwapInOutScheduler(host, device, budget)
    return make


if __name__ == "__main__":
    # python _nets.py BUDGET KIND AT: nnabla's scheduler over 5 iterations with iteration AT
    # of KIND; prints the losses (used by the tests in a subprocess: it may crash)
    import sys
    budget, kind, at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    losses, _ = train(5, nnabla_scheduler(budget), {at: kind})
    print("losses", losses, flush=True)
