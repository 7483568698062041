"""Compiled training out of core: vmalloc plans, torch.compile offloads and recomputes.

vmalloc records one iteration of a small MLP on the meta device, plans it under a byte budget
(the window scheduler, with recompute as a choice, over a link of LINK_GBPS), and turns the plan
into a selective-checkpoint policy: each activation is offloaded to the host, recomputed or
kept. ``torch.compile`` then lowers the policy: the graphs it compiles hold the offload /
reload copies and the recomputed ops. The loop trains a few steps next to an in-core compiled
copy of the model and checks that losses and weights agree.

Runs on CPU in seconds (backend ``aot_eager``: no C++ compiler needed); on CPU the offload is
a CPU-to-CPU copy, so it shows where a GPU would copy, not memory saved. Run::

    python examples/torch_compile_out_of_core.py
"""

import time

import torch
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

import vmalloc.torch

BATCH, WIDTH, DEPTH, STEPS = 2048, 256, 4, 3
LINK_GBPS = 6.0     # a slow link: two GELUs are recomputed (at 12 GB/s copies win)


def mlp(depth=DEPTH, width=WIDTH, seed=0):
    """DEPTH Linear + GELU layers of WIDTH, and a Linear to 10 classes (tests/offload/
    test_torch_compile.py trains this model too)."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def budget_of(model, depth=DEPTH):
    """Weights, gradients and momentum, and half the activations."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params + BATCH * WIDTH * 4 * 2 * depth // 2


def capturing(graphs):
    """aot_eager that also keeps the forward and backward graphs it runs."""
    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def train(model, x, y, loss_fn, seconds=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    losses = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if seconds is not None:
            seconds.append(time.perf_counter() - start)
    return losses


def main():
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    loss_fn = torch.nn.functional.cross_entropy
    model, reference = mlp(), mlp()
    budget = budget_of(model)

    start = time.perf_counter()
    plan = vmalloc.torch.policy(model, (x, y), loss_fn=loss_fn, budget=budget,
                                link_gbps=LINK_GBPS)
    planned = time.perf_counter() - start
    print(f"plan: {plan} in {planned:.2f} s")

    graphs = {}
    compiled = vmalloc.torch.compile_out_of_core(model, plan, backend=capturing(graphs))
    seconds = []
    losses = train(compiled, x, y, loss_fn, seconds)    # the first step compiles
    print(f"first step, compiling (aot_eager): {seconds[0]:.2f} s; later steps: "
          + ", ".join(f"{s:.3f} s" for s in seconds[1:]))
    forward, backward = graphs["forward"].code, graphs["backward"].code
    print(f"forward graph: {forward.count('= torch.ops.prims.device_put')} offload(s); "
          f"backward graph: {backward.count('= torch.ops.prims.device_put')} reload(s), "
          f"{backward.count('torch.ops.aten.gelu.default')} gelu recomputed")

    in_core = train(torch.compile(reference, backend="aot_eager"), x, y, loss_fn)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    print(f"losses out of core {losses}\nlosses in core     {in_core}")
    print(f"weights bit-identical: {same}; policy stats: {plan.stats()}")


if __name__ == "__main__":
    main()
