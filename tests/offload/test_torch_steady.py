"""Issue 21 item 1: the steady state of vmalloc.torch.out_of_core. Once the record repeats and
its schedule moves nothing, iterations run without the dispatch mode (no per-op Python, no
meta-device prediction); a divergence (other shapes, a shorter iteration, a new optimizer)
brings the mode back and the next iteration is recorded anew. Work is counted, never timed."""

import warnings

import pytest

torch = pytest.importorskip("torch")
import vmalloc.torch as vtorch  # noqa: E402


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))
            for n in sizes]


def step(model, opt, x, y, short=False, before_step=None):
    h = x
    for j, layer in enumerate(model):
        if short and j >= 3:
            break         # a shorter iteration: its module calls a prefix of the record's
        h = layer(h)
    loss = torch.nn.functional.cross_entropy(h, y)
    loss.backward()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train(data, short=(), before=None, **kw):
    """Losses, weights, the driver (None: plain PyTorch) and the stats after each step
    (``before``: a list to append the dispatched ops to before each optimizer step)."""
    model, opt = make()
    losses, after = [], []
    if not kw:
        losses = [step(model, opt, x, y, i in short) for i, (x, y) in enumerate(data)]
        return losses, list(model.parameters()), None, after
    with vtorch.out_of_core(backend="poison", device="cpu", **kw) as ooc:
        for i, (x, y) in enumerate(data):
            note = None if before is None else (
                lambda: before.append(ooc.stats()["dispatched_ops"]))
            losses.append(step(model, opt, x, y, i in short, note))
            after.append(dict(ooc.stats()))
    return losses, list(model.parameters()), ooc, after


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def ops_per_step(after, key="dispatched_ops"):
    return [b[key] - a[key] for a, b in zip([{key: 0}] + after, after)]


@pytest.mark.parametrize("budget", [None, "1GiB"], ids=["no-budget", "ample-budget"])
def test_steady_state_dispatches_nothing_and_is_bit_identical(budget):
    data = batches([64] * 7)
    ref, ref_w, _, _ = train(data)
    losses, w, ooc, after = train(data, budget=budget)
    assert losses == ref and same(w, ref_w)
    ops = ops_per_step(after)
    # record (new optimizer), record again, follow (the probation), then nothing per op
    assert min(ops[:3]) > 0
    assert ops[3:] == [0, 0, 0, 0]
    predictions = ops_per_step(after, "meta_predictions")
    assert predictions[3:] == [0, 0, 0, 0]
    assert (predictions[0] > 0) == (budget is not None)
    stats = ooc.stats()
    assert stats["steady_iterations"] == 4 and stats["steady_exits"] == 0
    assert stats["iterations"] == 7 and stats["scheduled_iterations"] == 5
    assert stats["recorded_iterations"] == 2 and stats["diverged_iterations"] == 0
    assert stats["swapped_out_bytes"] == 0


def test_a_new_shape_in_the_steady_state_is_caught_at_once_and_recorded_anew():
    data = batches([64] * 4 + [128] + [64] * 5)
    ref, ref_w, _, _ = train(data)
    losses, w, ooc, after = train(data, budget="1GiB")
    assert losses == ref and same(w, ref_w)
    ops = ops_per_step(after)
    assert ops[3] == 0                   # steady
    assert ops[4] > 0                    # the batch of 128: the mode back from its first call
    # 5 records (64 again after 128), 6 is the probation, then steady again
    assert ops[5] > 0 and ops[6] > 0 and ops[7:] == [0, 0, 0]
    stats = ooc.stats()
    assert stats["steady_exits"] == 1 and stats["steady_iterations"] == 4
    assert stats["diverged_iterations"] == 1 and stats["recorded_iterations"] == 3
    assert stats["iterations"] == 10
    assert "differs from the record" in ooc.runtime.last_divergence


def test_a_shorter_iteration_is_caught_at_the_boundary():
    data = batches([64] * 8)
    ref, ref_w, _, _ = train(data, short=(4,))
    before = []
    losses, w, ooc, after = train(data, short=(4,), before=before, budget=None)
    assert losses == ref and same(w, ref_w)
    ops = ops_per_step(after)
    # the short step ran plain up to its end...
    assert ops[3] == 0 and before[4] == after[3]["dispatched_ops"]
    assert ops[5] > 0 and ops[6] > 0 and ops[7] == 0    # ...then records, probation, steady
    stats = ooc.stats()
    # 3 and 7 steady, 4 too (found diverged at its end)
    assert stats["steady_exits"] == 1 and stats["steady_iterations"] == 3
    assert stats["iterations"] == 8 and stats["diverged_iterations"] == 1
    assert stats["recorded_iterations"] == 3 and stats["scheduled_iterations"] == 5
    assert "module calls" in ooc.runtime.last_divergence


def test_under_budget_pressure_every_step_stays_on_the_dispatch_path():
    """A schedule that swaps is followed op by op as before (its room made per op), within
    the budget, bit-identical; a step that departs is recorded anew. Predictions are kept per
    op and shapes: only new shapes run on the meta device (the first step, the 96 rows)."""
    data = batches([64] * 4 + [96] + [64] * 2)
    ref, ref_w, _, _ = train(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, w, ooc, after = train(data, budget="2MiB")
    assert losses == ref and same(w, ref_w)
    stats = ooc.stats()
    assert stats["swapped_out_bytes"] > 0 and stats["scheduled_swap_outs"] > 0
    assert stats["steady_iterations"] == 0 and stats["steady_exits"] == 0
    assert 0 not in ops_per_step(after)
    predictions = ops_per_step(after, "meta_predictions")
    assert predictions[0] > 0 and predictions[1:4] == [0, 0, 0]
    assert predictions[4] > 0 and predictions[5:] == [0, 0]
    assert stats["peak_device_bytes"] <= stats["budget_bytes"] == 2 << 20
    assert stats["over_budget"] == 0 and stats["over_budget_ops"] == 0
    assert stats["diverged_iterations"] == 1 and stats["recorded_iterations"] == 3


def test_a_new_optimizer_in_the_steady_state_records_anew():
    data = batches([64] * 8)
    model, opt = make()
    ref_model, ref_opt = make()
    ref_opt2 = torch.optim.SGD(ref_model[4].parameters(), lr=0.01)
    opt2 = torch.optim.SGD(model[4].parameters(), lr=0.01)
    ref, losses = [], []
    for i, (x, y) in enumerate(data):
        ref.append(step(ref_model, ref_opt, x, y))
        if i == 4:
            ref_opt2.step()
    with vtorch.out_of_core(backend="poison", device="cpu") as ooc:
        for i, (x, y) in enumerate(data):
            losses.append(step(model, opt, x, y))
            if i == 4:
                opt2.step()     # (no gradients: a no-op step, first seen here)
    assert losses == ref and same(model.parameters(), ref_model.parameters())
    stats = ooc.stats()
    assert stats["steady_exits"] == 1
    # 0, 1 record, 2 probation, 3 and 4 steady; 5 records, 6 probation, 7 steady
    assert stats["steady_iterations"] == 3
    assert "new optimizer" in ooc.runtime.last_divergence


def test_manual_steps_reach_the_steady_state_too():
    data = batches([64] * 6)
    ref, ref_w, _, _ = train(data)
    model, opt = make()
    losses, counts = [], []
    with vtorch.out_of_core(backend="poison", device="cpu") as ooc:
        for x, y in data:
            with ooc.step():
                losses.append(step(model, opt, x, y))
            counts.append(ooc.stats()["dispatched_ops"])
    assert losses == ref and same(model.parameters(), ref_w)
    assert counts[3:] == [counts[2]] * 3
    assert ooc.stats()["steady_iterations"] == 3


def test_the_mode_is_gone_in_the_steady_state_and_back_after_the_block():
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    data = batches([64] * 4)
    model, opt = make()
    with vtorch.out_of_core(backend="poison", device="cpu") as ooc:
        for x, y in data:
            step(model, opt, x, y)
        assert _get_current_dispatch_mode() is None and ooc._steady.active
    assert _get_current_dispatch_mode() is None
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_a_program_that_keeps_departing_stays_on_the_dispatch_path_after_three_exits():
    # every fourth batch is larger: 3 (and 7, 11) depart at once; 4 records, 5 is the
    # probation, 6 steady; after the third exit (11) no probation any more
    data = batches([64, 64, 64, 128] * 5)
    ref, ref_w, _, _ = train(data)
    losses, w, ooc, after = train(data, budget="1GiB")
    assert losses == ref and same(w, ref_w)
    stats = ooc.stats()
    assert stats["steady_exits"] == 3 and stats["steady_iterations"] == 2
    ops = ops_per_step(after)
    assert [i for i, n in enumerate(ops) if n == 0] == [6, 10]


def test_a_long_steady_stretch_starts_the_exit_count_anew():
    # 3 departs before any steady iteration counted; then steady stretches of 8 or more
    # reset the count: four departures in all, never three in a row
    sizes = [64] * 3 + [128] + ([64] * 11 + [128]) * 3 + [64] * 4
    data = batches(sizes)
    ref, ref_w, _, _ = train(data)
    losses, w, ooc, after = train(data, budget=None)
    assert losses == ref and same(w, ref_w)
    stats = ooc.stats()
    assert stats["steady_exits"] == 4
    assert ops_per_step(after)[-1] == 0            # steady at the end


def test_a_module_made_anew_in_every_forward_keeps_the_steady_state():
    # Hugging Face's BERT makes its CrossEntropyLoss module in every forward: the calls are
    # compared by the module's class, not its object (before: an exit at every such step)
    data = batches([64] * 6)
    model, opt = make()
    ref_model, ref_opt = make()

    def one(model, opt, x, y):
        loss = torch.nn.CrossEntropyLoss()(model(x), y)     # a new module object each time
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    ref = [one(ref_model, ref_opt, x, y) for x, y in data]
    with vtorch.out_of_core(backend="poison", device="cpu") as ooc:
        losses = [one(model, opt, x, y) for x, y in data]
    assert losses == ref and same(model.parameters(), ref_model.parameters())
    assert ooc.stats()["steady_exits"] == 0 and ooc.stats()["steady_iterations"] == 3


def test_a_storage_resized_in_the_steady_state_records_anew():
    # FSDP2 frees and regrows parameters with UntypedStorage.resize_, outside the dispatcher:
    # seen at the iteration's end, after which the steady state is not entered again
    data = batches([64] * 7)
    ref, ref_w, _, _ = train(data)
    model, opt = make()
    losses = []
    with vtorch.out_of_core(backend="poison", device="cpu") as ooc:
        for i, (x, y) in enumerate(data):
            if i == 4:
                torch.empty(16).untyped_storage().resize_(128)
            losses.append(step(model, opt, x, y))
    assert losses == ref and same(model.parameters(), ref_w)
    stats = ooc.stats()
    assert stats["steady_exits"] == 1 and stats["steady_iterations"] == 2   # 3 and 4
    assert "resized" in ooc.runtime.last_divergence and stats["iterations"] == 7
