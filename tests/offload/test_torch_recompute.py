"""Recompute executed by the PyTorch driver (issue 16 item 2), on CPU with the poison backend: a
dropped storage is poisoned (0xFF: NaN) and the driver re-dispatches the aten op that wrote it
before its next use, so bit-identical losses and weights prove that every recompute happened
and reproduced the same bits."""

import os
import sys
import warnings

import pytest

import vmalloc

torch = pytest.importorskip("torch")

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.frameworks.torch_recompute import rerunnable  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _dist import train  # noqa: E402  (the SGD pass the two-rank workers run)

CH = 16


def make(seed=0, depth=6):
    """A BatchNorm + ReLU network: conv (no bias) -> BN -> ReLU blocks, pooled, linear."""
    torch.manual_seed(seed)
    layers = [torch.nn.Conv2d(3, CH, 3, padding=1, bias=False), torch.nn.BatchNorm2d(CH),
              torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Conv2d(CH, CH, 3, padding=1, bias=False), torch.nn.BatchNorm2d(CH),
                   torch.nn.ReLU()]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(CH, 10)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def data(steps, batch=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]


def run(budget=None, steps=4, **kw):
    model, opt = make()
    batches = data(steps)
    if budget is None:
        return train(model, opt, batches), [p.detach().clone() for p in model.parameters()], None
    with vtorch.out_of_core(budget=budget, backend="poison", device="cpu", **kw) as ooc:
        losses = train(model, opt, batches)
    return losses, [p.detach().clone() for p in model.parameters()], ooc


def test_bn_relu_network_bit_identical_with_recompute():
    ref_losses, ref_w, _ = run()
    losses, w, ooc = run(budget="24MiB", recompute=True)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(w, ref_w))
    stats = ooc.stats()
    rt = ooc.runtime
    assert rt.schedule is not None and rt.schedule.recompute is not None
    per_iteration = rt.schedule.recomputed_functions()
    assert per_iteration > 0
    # recorded twice (the optimizer's first step invalidates the first record), then followed
    assert stats["recorded_iterations"] == 2 and stats["scheduled_iterations"] == 2
    assert stats["recomputed_functions"] == 2 * per_iteration
    assert stats["recompute_drops"] == 2 * per_iteration
    _, _, swap_only = run(budget="24MiB")
    assert stats["swapped_out_bytes"] < swap_only.stats()["swapped_out_bytes"]


def test_which_ops_are_rerunnable():
    aten = torch.ops.aten
    assert rerunnable(aten.relu.default, "cpu")
    assert rerunnable(aten.convolution.default, "cpu")
    assert not rerunnable(aten.relu_.default, "cpu")              # mutates its input
    assert not rerunnable(aten.native_dropout.default, "cpu")     # seeded random
    assert not rerunnable(aten.add.out, "cpu")                    # out= argument
    assert rerunnable(aten.index_add.default, "cpu")
    assert not rerunnable(aten.index_add.default, "cuda")         # atomics: not bitwise
    assert rerunnable(aten.relu.default, "cuda")
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not rerunnable(aten.convolution.default, "cuda")   # cuDNN may pick atomics
        torch.use_deterministic_algorithms(True)
        assert rerunnable(aten.convolution.default, "cuda")
    finally:
        torch.use_deterministic_algorithms(was)


class Oom(RuntimeError):
    pass


def train_with_a_failing_step(model, opt, batches, fail_at, where):
    """The OOM-retry pattern: step ``fail_at`` raises (``where``: in the forward, halfway, or
    in the backward), the loop catches it, the graph is freed, training goes on."""
    losses = []
    layer = model[len(model) // 2]
    for i, (x, y) in enumerate(batches):
        def boom(*_):
            if i == fail_at:
                raise Oom("CUDA out of memory (simulated)")
        handle = (layer.register_forward_hook(boom) if where == "forward"
                  else layer.register_full_backward_hook(boom))
        try:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        except Oom:
            losses.append(None)
        finally:
            handle.remove()
            opt.zero_grad()
            loss = None
    return losses


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_recompute_survives_the_oom_retry_pattern(where):
    # Before issue 20's fix: "swap_in: the storage ... was freed" while autograd freed the graph.
    # Steps 0 and 1 are recorded, step 2 (the first to drop storages) fails, 3 goes on.
    batches = data(4)
    model, opt = make()
    ref = train_with_a_failing_step(model, opt, batches, 2, where)
    ref_w = [p.detach().clone() for p in model.parameters()]
    model, opt = make()
    with vtorch.out_of_core(budget="24MiB", backend="poison", device="cpu",
                            recompute=True) as ooc:
        losses = train_with_a_failing_step(model, opt, batches, 2, where)
    assert losses == ref and ref[2] is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_w))
    assert ooc.stats()["recompute_drops"] > 0


def test_leaving_the_block_mid_step_raises_the_programs_error():
    model, opt = make()
    batches = data(4)
    with pytest.raises(Oom, match="simulated"):
        with vtorch.out_of_core(budget="24MiB", backend="poison", device="cpu",
                                recompute=True) as ooc:
            for i, (x, y) in enumerate(batches):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if i == 3:
                    raise Oom("CUDA out of memory (simulated)")
                loss.backward()
                opt.step()
                opt.zero_grad()
    assert ooc.stats()["recompute_drops"] > 0
    assert all(b.state == "resident" for b in ooc.runtime.buffers())


def test_a_recompute_failing_on_the_way_out_does_not_mask_the_programs_error(monkeypatch):
    from vmalloc.frameworks import torch_recompute

    model, opt = make()
    batches = data(4)
    with pytest.warns(RuntimeWarning, match=r"leaving out_of_core after Oom failed too: "
                                            r"RecomputeError: buffer \d+ could "
                                            r"not be recomputed.*rerun broke"):
        with pytest.raises(Oom, match="simulated"):
            with vtorch.out_of_core(budget="24MiB", backend="poison", device="cpu",
                                    recompute=True):
                for i, (x, y) in enumerate(batches):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    if i == 2:     # mid-step, with storages dropped: no rerun works any more
                        def broken(self, ptrs=None):
                            raise RuntimeError("rerun broke")
                        monkeypatch.setattr(torch_recompute.AtenRerun, "__call__", broken)
                        raise Oom("CUDA out of memory (simulated)")
                    loss.backward()
                    opt.step()
                    opt.zero_grad()


def test_nested_out_of_core_is_refused_and_the_outer_block_goes_on():
    # Before issue 20's fix: NaN losses from the first step, no error.
    batches = data(4)
    model, opt = make()
    ref = train(model, opt, batches)
    model, opt = make()
    with vtorch.out_of_core(budget="24MiB", backend="poison", device="cpu") as outer:
        losses = train(model, opt, batches[:2])
        inner = vtorch.out_of_core(budget="24MiB", backend="poison", device="cpu")
        with pytest.raises(vmalloc.InvalidArgumentError,
                           match="out_of_core blocks do not nest: one is active"):
            with inner:
                pass
        losses += train(model, opt, batches[2:])
    assert losses == ref
    assert outer.stats()["scheduled_iterations"] == 2
    with vtorch.out_of_core(budget="24MiB", backend="poison", device="cpu"):
        pass                       # once left, a block may be entered again


def test_a_rerun_reads_through_temporary_tensor_objects():
    # An op reads a temporary view of a storage the program keeps (a transformer's
    # x.view(...) into a linear, the 3-D view of addmm's output into an activation) and its
    # output object is replaced by a view of it. Before, the rerun held the tensor objects by
    # weak reference: both died with the temporaries, ready() was False and the runtime refused
    # every planned drop of the output. Now it holds their storages (and views of them).
    import gc

    from vmalloc.frameworks.torch_recompute import AtenRerun

    x = torch.randn(64, 256)
    v = x.view(64, 2, 128)
    out = torch.tanh(v)
    rerun = AtenRerun.make(torch.ops.aten.tanh.default, (v,), {}, out, lambda t: True)
    want = out.clone()
    x_then, threads_then = x.clone(), torch.get_num_threads()
    kept = out.view(64, 256)       # the program keeps only a view of the output
    del v, out
    gc.collect()
    assert rerun.ready()
    kept.fill_(float("nan"))       # dropped: its bytes are gone
    rerun()
    # Seen once in a full suite run, not reproduced since: the rerun differed by up to 5e-5 on
    # half the elements. If it comes back, this says whether the input or the threads changed.
    assert torch.equal(x, x_then) and torch.get_num_threads() == threads_then
    diff = (kept.view(64, 2, 128) - want).abs()
    assert torch.equal(kept.view(64, 2, 128), want), (
        f"rerun differs on {int((diff != 0).sum())} of {diff.numel()} elements, by up to "
        f"{diff.max().item()}; threads {threads_then}, input at {x.data_ptr() % 64} mod 64")
    del x                          # the input's storage itself gone: the rerun cannot run
    gc.collect()
    assert not rerun.ready()
    with pytest.raises(RuntimeError, match="an input of aten.tanh.default is gone"):
        rerun()


def transformer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 2048, dropout=0.0, activation="gelu",
                                             batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return enc, torch.optim.SGD(enc.parameters(), lr=0.01)


def train_transformer(budget=None, **kw):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 64, 64, generator=g) for _ in range(4)]   # (made outside the block)
    model, opt = transformer()

    def steps():
        losses = []
        for x in xs:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    if budget is None:
        return steps(), None
    with vtorch.out_of_core(budget=budget, backend="poison", device="cpu", **kw) as ooc:
        losses = steps()
    return losses, ooc


def test_a_transformer_encoder_recomputes_what_it_plans_bit_identical():
    # issue 21: on a TransformerEncoder every planned drop was refused (a rerun's input or
    # output tensor was a temporary view, gone); here each planned drop is followed.
    ref, _ = train_transformer()
    _, free = train_transformer(budget=1 << 40)
    budget = free.stats()["peak_device_bytes"] * 65 // 100
    losses, ooc = train_transformer(budget=budget, recompute=True)
    assert losses == ref
    stats = ooc.stats()
    per_iteration = ooc.runtime.schedule.recomputed_functions()
    assert per_iteration == 1       # the gelu of one layer's feed-forward (v100 cost model)
    assert stats["recorded_iterations"] == 2 and stats["scheduled_iterations"] == 2
    assert stats["recomputed_functions"] == stats["recompute_drops"] == 2 * per_iteration
    assert stats["recompute_refused"] == 0 and stats["recompute_reason"] is None
    swap_losses, swap_only = train_transformer(budget=budget)
    assert swap_losses == ref
    assert stats["on_demand_swap_ins"] == swap_only.stats()["on_demand_swap_ins"]
    assert stats["swapped_out_bytes"] < swap_only.stats()["swapped_out_bytes"]


def test_a_transformer_whose_reruns_cannot_run_is_planned_again_and_said_once(monkeypatch):
    # Every rerun says it cannot run (as when its input was a temporary that is gone): each
    # planned drop is refused, the plan is made again without it (the next candidate is then
    # refused too, and planned away), said once; losses stay bit-identical.
    from vmalloc.frameworks import torch_recompute

    ref, _ = train_transformer()
    _, free = train_transformer(budget=1 << 40)
    budget = free.stats()["peak_device_bytes"] * 65 // 100
    monkeypatch.setattr(torch_recompute.AtenRerun, "ready", lambda self: False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        losses, ooc = train_transformer(budget=budget, recompute=True)
    assert losses == ref
    stats = ooc.stats()
    reason = ("1 planned drop(s) could not be followed (its function's rerun cannot run (an "
              "input or its output is gone)): planned again without them")
    assert stats["recompute_refused"] == 2 and stats["recompute_drops"] == 0
    assert stats["recomputed_functions"] == 0 and stats["recompute_reason"] == reason
    assert [str(w.message) for w in said if "recompute" in str(w.message)] == [
        f"recompute=True: {reason}"]
    assert ooc.runtime.schedule.recompute is None     # the plain plan in the end
