"""vmalloc.torch.out_of_core on CPU tensors with the poisoning backend.

A swapped-out storage is overwritten with 0xFF bytes (NaN) until it is swapped in, so a
schedule that lets any op read a storage that is not resident changes the losses: equality
with an ordinary run, bit for bit, is the proof that every op found its storages resident.
"""

import pytest

torch = pytest.importorskip("torch")

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.frameworks.torch_out_of_core import PoisonSwap  # noqa: E402

WIDTH = 512


def make(seed=0, depth=3):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(256, WIDTH), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, 10))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def data(steps, batch=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def train(model, opt, batches, extra=()):
    """Plain training loop; ``extra`` lists steps that run one more op (a data-dependent
    branch) and ``-i`` entries steps that skip the last hidden layer's ReLU."""
    losses = []
    for i, (x, y) in enumerate(batches):
        h = x
        for j, layer in enumerate(model):
            if -i in extra and i and j == len(model) - 2:
                continue      # a shorter iteration
            h = layer(h)
            if i in extra and j == 0:
                h = h * 1.0 + 0.0  # a longer iteration: two more ops on a hidden activation
        loss = torch.nn.functional.cross_entropy(h, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def run(budget=None, steps=6, extra=(), backend="poison", **kw):
    model, opt = make()
    batches = data(steps)
    if budget is None:
        return train(model, opt, batches, extra), weights(model), None
    with vtorch.out_of_core(budget=budget, backend=backend, device="cpu", **kw) as ooc:
        losses = train(model, opt, batches, extra)
    return losses, weights(model), ooc.stats()


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_training_is_bit_identical_under_a_budget_and_swaps():
    ref_losses, ref_w, _ = run()
    losses, w, stats = run(budget="8MiB")
    assert losses == ref_losses
    assert same(w, ref_w)
    assert stats["iterations"] == 6
    assert stats["recorded_iterations"] == 2      # first sight of the optimizer, then again
    assert stats["scheduled_iterations"] == 4
    assert stats["diverged_iterations"] == 0
    assert stats["scheduled_swap_outs"] > 0 and stats["scheduled_swap_ins"] > 0
    assert stats["swapped_out_bytes"] > 0
    assert stats["swap"]["host_bytes"] == 0       # everything back on exit


def test_in_core_budget_makes_no_transfers():
    losses, _, stats = run(budget="1GiB")
    assert losses == run()[0]
    assert stats["swapped_out_bytes"] == 0 and stats["swapped_in_bytes"] == 0


@pytest.mark.parametrize("extra", [(3,), (-3,), (2, -4)], ids=["longer", "shorter", "both"])
def test_iterations_that_differ_from_the_record_stay_correct(extra):
    ref_losses, ref_w, _ = run(extra=extra)
    losses, w, stats = run(budget="8MiB", extra=extra)
    assert losses == ref_losses
    assert same(w, ref_w)
    assert stats["diverged_iterations"] >= 1
    assert stats["reschedules"] >= 2


def test_a_backend_that_loses_data_is_caught():
    """The test can fail: a swap-in that does not restore the bytes changes the losses."""

    class Lossy(PoisonSwap):
        def swap_in(self, key, stream=0):
            self._host[key].fill_(0)   # the host copy is lost
            return super().swap_in(key, stream)

    ref_losses, _, _ = run()
    backend = Lossy()
    model, opt = make()
    with vtorch.out_of_core(budget="8MiB", backend=backend, device="cpu") as ooc:
        losses = train(model, opt, data(6))
    assert ooc.stats()["swapped_in_bytes"] > 0
    assert losses != ref_losses


def test_min_bytes_keeps_small_storages_untracked():
    _, _, stats = run(budget="8MiB", min_bytes=1 << 30)
    assert stats["functions"] == 0
    assert stats["swapped_out_bytes"] == 0
