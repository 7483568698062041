"""vmalloc.torch.out_of_core with tensors that are not plain (issue 21 items 3 and 4): wrapper
tensor subclasses (PyTorch's TwoTensor) train through their inner tensors, bit-identical to
training without vmalloc; an op whose outputs no meta kernel predicts is measured after it
runs, so running over the budget is counted and said (raised under strict), never silent.

FSDP2 under two gloo ranks: tests/offload/test_torch_fsdp2.py. Small tensors, the poison
backend: an op that reads a swapped-out storage changes the results.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.errors import OutOfMemoryError  # noqa: E402
from vmalloc.offload.runtime import BudgetWarning  # noqa: E402

TwoTensor = two_tensor.TwoTensor
STEPS = 4


def _two_tensor_job(budget, driver=True):
    """A TwoTensor parameter trained on TwoTensor inputs (driver False: without vmalloc)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    w = torch.nn.Parameter(TwoTensor(lin.weight.detach().clone(),
                                     lin.weight.detach().clone() * 2))
    opt = torch.optim.SGD([w], lr=1e-4, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(512, 64, generator=g) for _ in range(STEPS)]

    def loop():
        losses = []
        for x in xs:
            loss = (TwoTensor(x, x.clone()) @ w).relu().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((loss.a.item(), loss.b.item()))
        return losses

    if not driver:
        return loop(), (w.a.clone(), w.b.clone()), None
    with vtorch.out_of_core(backend="poison", device="cpu", budget=budget,
                            min_bytes=1024) as ooc:
        losses = loop()
    return losses, (w.a.clone(), w.b.clone()), ooc.stats()


@pytest.mark.parametrize("budget", ["none", 300_000])
def test_two_tensor_training_is_bit_identical(budget):
    """Before: 'Attempted to access the data pointer on an invalid python storage' at the
    first op, budget or not."""
    ref_losses, ref_w, _ = _two_tensor_job(None, driver=False)
    losses, w, stats = _two_tensor_job(None if budget == "none" else budget)
    assert losses == ref_losses
    assert torch.equal(w[0], ref_w[0]) and torch.equal(w[1], ref_w[1])
    assert stats["iterations"] == STEPS
    if budget != "none":
        # The inner storages are tracked, so they swap (the poison backend proves them).
        assert stats["peak_device_bytes"] <= budget, stats
        assert stats["scheduled_swap_outs"] > 0 and stats["scheduled_swap_ins"] > 0, stats
        assert stats["over_budget_ops"] == 0 and stats["over_budget"] == 0, stats


def _grow_op():
    """A custom op with a CPU kernel and no fake (meta) kernel: its outputs' bytes cannot be
    predicted before it runs (4x its input)."""
    name = "vmalloc_test_subclass::grow"
    if not hasattr(_grow_op, "op"):
        @torch.library.custom_op(name, mutates_args=())
        def grow(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x, x, x])
        _grow_op.op = grow
    return _grow_op.op


def _unpredicted_job(budget, strict=False):
    torch.manual_seed(0)
    grow = _grow_op()
    lin = torch.nn.Linear(256, 256, bias=False)      # 256 KiB weight
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    x = torch.randn(128, 256)                        # 128 KiB; grow(x): 512 KiB
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = None
        try:
            with vtorch.out_of_core(backend="poison", device="cpu", budget=budget,
                                    min_bytes=4096, strict=strict) as ooc:
                for _ in range(3):
                    loss = lin(x).sum() + grow(x).sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
        except OutOfMemoryError as e:
            error = e
    said = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    return ooc.stats(), said, error, losses


def test_an_op_without_meta_kernel_that_runs_over_the_budget_is_counted_and_said_once():
    """Before: over_budget_ops 0 and no warning while the peak (896 KiB) exceeded the 700 kB
    budget: nothing predicted grow's 512 KiB of outputs, nothing measured them."""
    stats, said, error, losses = _unpredicted_job(700_000)
    assert error is None and len(losses) == 3
    # x (128 KiB), the weight (256 KiB) and grow's output (512 KiB) at once
    assert stats["peak_device_bytes"] == 917504
    # Once, in the first iteration: the measure is kept, the next runs make room first.
    assert stats["over_budget_ops"] == 1, stats
    assert len(said) == 1, said
    assert "vmalloc_test_subclass.grow" in said[0] and "524288 bytes" in said[0], said
    assert "no meta kernel" in said[0] and "700000" in said[0], said


def test_an_op_without_meta_kernel_under_strict_raises():
    stats, said, error, losses = _unpredicted_job(700_000, strict=True)
    assert isinstance(error, OutOfMemoryError), error
    assert "vmalloc_test_subclass.grow" in str(error) and "strict=True" in str(error)
    assert said == [] and losses == []
    assert stats["over_budget_ops"] == 1


def test_an_op_without_meta_kernel_within_the_budget_says_nothing():
    stats, said, error, losses = _unpredicted_job(4 << 20)
    assert error is None and said == [] and stats["over_budget_ops"] == 0
    assert stats["peak_device_bytes"] <= 4 << 20


@pytest.mark.parametrize("budget", [6_000_000, 14_000_000, 15_000_000, 32_000_000])
def test_lstm_under_a_budget_keeps_it_or_says_it_did_not(budget):
    """A small 2-layer nn.LSTM on CPU: aten.mkldnn_rnn_layer's meta kernel predicts 425,984
    bytes of outputs where the op creates 6,705,152 (its workspace). Before, under 14 MB the
    peak was 14,974,976 bytes with over_budget_ops 0 and no warning. Now the peak exceeds the
    budget exactly when stats count an over-budget op or allocation, and then one
    BudgetWarning says so."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(64, 128, num_layers=2)
    opt = torch.optim.SGD(lstm.parameters(), lr=0.01)
    x = torch.randn(50, 16, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtorch.out_of_core(backend="poison", device="cpu", budget=budget,
                                min_bytes=4096) as ooc:
            for _ in range(3):
                out, _ = lstm(x)
                out.sum().backward()
                opt.step()
                opt.zero_grad()
    stats = ooc.stats()
    said = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    over = stats["peak_device_bytes"] > budget
    assert over == (stats["over_budget_ops"] + stats["over_budget"] > 0), stats
    assert len(said) == (1 if over else 0), said
    if budget == 14_000_000:
        # Learned from its first run: later runs make room first (one op over, once).
        assert stats["peak_device_bytes"] == 14565376 and stats["over_budget_ops"] == 1
        assert said == ["function 3 (aten.mkldnn_rnn_layer.default) created 6705152 bytes of "
                        "outputs, where its meta kernel predicted 425984, and the device held "
                        "14565376 bytes, more than the budget of 14000000 bytes: it ran over "
                        "the budget (later runs of this op on these shapes make room first)"]
