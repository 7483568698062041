"""vmalloc.torch.out_of_core says what it cannot do, never silently (issue 20, item 5): a CUDA
device PyTorch lacks is refused, budget warnings point at the user's line and name the function
one way, an op over the budget runs over with one warning or, under strict, is refused, and
recompute says once why it recomputes nothing."""

import warnings

import pytest

torch = pytest.importorskip("torch")

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.errors import InvalidArgumentError, OutOfMemoryError  # noqa: E402
from vmalloc.offload.runtime import BudgetWarning  # noqa: E402


def make(seed=0, width=256):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(steps, batch=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 128, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this PyTorch has CUDA")
@pytest.mark.parametrize("backend", [None, "poison"])
def test_a_cuda_device_without_cuda_is_refused(backend):
    # Was a block that tracked no tensor, did nothing and said nothing.
    with pytest.raises(InvalidArgumentError) as info:
        vtorch.out_of_core(device="cuda", backend=backend)
    assert str(info.value) == (
        f"device='cuda' but this PyTorch ({torch.__version__}) has no CUDA device: no tensor "
        "would be tracked; use device='cpu' with backend='poison' to train out of core on the "
        "CPU")


def test_an_unknown_device_is_refused():
    with pytest.raises(InvalidArgumentError) as info:
        vtorch.out_of_core(device="tpu", backend="poison")
    assert str(info.value) == "device must be 'cuda' or 'cpu', got 'tpu'"


def step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)   # the line ops warn at
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def run_recording(data, model=None, opt=None, **ooc):
    if model is None:
        model, opt = make()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with vtorch.out_of_core(backend="poison", device="cpu", **ooc) as driver:
            losses = [step(model, opt, x, y) for x, y in data]
    return losses, said, driver


def test_an_op_over_the_budget_runs_over_it_said_once_at_the_users_line():
    # Was two BudgetWarnings (the driver's and the runtime's), both pointing into
    # vmalloc/frameworks/torch_out_of_core.py, naming the op two ways ("aten.addmm.default"
    # and "function 2 (aten.addmm.default)"), and the docs said it raised OutOfMemoryError.
    data = batches(3)
    ref, _, _ = run_recording(data)
    losses, said, driver = run_recording(data, budget="200KiB")
    assert losses == ref
    budget = [w for w in said if issubclass(w.category, BudgetWarning)]
    assert [str(w.message) for w in budget] == [
        "function 0 (aten.addmm.default) needs 131072 bytes for its outputs besides its "
        "inputs, more than the budget of 204800 bytes leaves: it runs over the budget"]
    assert budget[0].filename == __file__
    stats = driver.stats()
    assert stats["over_budget_ops"] > 0 and stats["peak_device_bytes"] > 200 << 10
    assert stats["schedule_error"].startswith(
        "no schedule fits the budget of 204800 bytes: function 0 (aten.addmm.default) needs "
        "327680 bytes at once. The scheduler said: function 0 (aten.addmm.default) needs "
        "320.00 KiB (327680 bytes)")


def test_under_strict_an_op_over_the_budget_is_refused_and_says_so():
    # The error raised said "it runs above the budget".
    model, opt = make()
    x, y = batches(1)[0]
    with pytest.raises(OutOfMemoryError) as info:
        with vtorch.out_of_core(budget="200KiB", backend="poison", device="cpu", strict=True):
            step(model, opt, x, y)
    assert str(info.value) == (
        "function 0 (aten.addmm.default) needs 131072 bytes for its outputs besides its inputs, "
        "more than the budget of 204800 bytes leaves: refused (strict=True); the op did not run")
    assert info.value.requested_bytes == 131072


def test_an_unmeetable_schedule_is_said_once_at_the_users_line():
    _, said, driver = run_recording(batches(3), budget="1MiB", scheduler="none")
    budget = [w for w in said if issubclass(w.category, BudgetWarning)]
    assert len(budget) == 1 and budget[0].filename == __file__
    assert driver.stats()["schedule_failures"] >= 1   # (stats keep the latest message)
    assert str(budget[0].message).startswith("no schedule fits the budget of 1048576 bytes: "
                                             "function 9 (aten.mm.default): device bytes")


def transformer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0),
        torch.nn.Flatten(), torch.nn.Linear(64 * 16, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_recompute_says_once_why_it_recomputes_nothing():
    # An MLP and a transformer under budget pressure recomputed nothing and said nothing.
    g = torch.Generator().manual_seed(1)
    tokens = [(torch.randn(32, 16, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
              for _ in range(3)]
    for data, (model, opt), reason in (
            (batches(3), make(),
             "no buffer goes unused long enough between its uses to be dropped"),
            (tokens, transformer(), "nothing is cheaper to recompute than its swap")):
        _, said, driver = run_recording(data, model, opt, budget="1MiB", recompute=True)
        stats = driver.stats()
        assert stats["recompute_reason"] == reason
        assert stats["recompute_drops"] == 0 and stats["swapped_out_bytes"] > 0
        told = [w for w in said if "recomputes nothing" in str(w.message)]
        assert [str(w.message) for w in told] == [f"recompute=True recomputes nothing: {reason}"]
        assert told[0].filename == __file__


def test_recompute_without_a_budget_says_there_is_no_pressure():
    _, said, driver = run_recording(batches(2), recompute=True)
    assert driver.stats()["recompute_reason"] == "no budget pressure: nothing is swapped"
    assert sum("recomputes nothing" in str(w.message) for w in said) == 1
