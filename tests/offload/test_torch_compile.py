"""Compiled training with vmalloc's plan (issue 21 item 2): vmalloc.torch.policy maps the plan's
per-activation decisions onto selective-checkpoint policies, and torch.compile (backend
aot_eager, on CPU) lowers them: the captured forward graph holds one ``cpu_offload_*`` copy per
planned offload and the backward graph its ``gpu_reload_*`` copy and the recomputed ops; losses
and weights are bit-identical to compiled in-core training (offload on CPU is a CPU-to-CPU copy
and recompute re-runs the same kernel on the same inputs)."""

import importlib.util
import pathlib
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="vmalloc.torch.policy needs PyTorch")

import torch._functorch.config as functorch_config  # noqa: E402

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.errors import InvalidArgumentError  # noqa: E402
from vmalloc.frameworks.torch_compile import CPU_LINK_GBPS, _mark_offloads  # noqa: E402
from vmalloc.offload.scheduling.schedule import ScheduleError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name, path):
    # examples and test helpers are no package (pytest's importlib mode: not on sys.path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _example_module():
    # the model, its budget and the training loop are the example's
    return _load("_torch_compile_example", ROOT / "examples" / "torch_compile_out_of_core.py")


example = _example_module()
graphs_of = _load("_compile_graphs", ROOT / "tests" / "offload" / "_compile_graphs.py")
device_puts, offloaded_keys, region_keys = \
    graphs_of.device_puts, graphs_of.offloaded_keys, graphs_of.region_keys
BATCH, WIDTH, DEPTH = example.BATCH, example.WIDTH, example.DEPTH
LOSS = torch.nn.functional.cross_entropy
mlp, budget_of, capturing = example.mlp, example.budget_of, example.capturing


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def train(model, x, y):
    return example.train(model, x, y, LOSS)


@pytest.fixture(scope="module")
def trained():
    x, y = data()
    model, reference = mlp(), mlp()
    # 6 GB/s: at 12 the swap-only plan wins since reservations take the budget at their
    # function (tests/offload/test_window_reservation.py); a slower link keeps recompute chosen
    plan = vtorch.policy(model, (x, y), loss_fn=LOSS, budget=budget_of(model), link_gbps=6)
    graphs = {}
    losses = train(vtorch.compile_out_of_core(model, plan, backend=capturing(graphs)), x, y)
    in_core = train(torch.compile(reference, backend="aot_eager"), x, y)
    return plan, graphs, model, reference, losses, in_core


def test_plan_decisions_at_6_gbps(trained):
    plan = trained[0]
    # The window scheduler under the budget keeps the last layers' activations, recomputes
    # two GELUs (memory-bound: cheaper than two copies over 6 GB/s) and offloads the rest.
    assert plan.stats() == {"save": 5, "recompute": 2, "offload": 2,
                            "persistent_swaps_ignored": 20, "unmatched_ops": 0,
                            "recompute_refused": 0, "offload_refused": 0,
                            "offloads_run_eagerly": 0}
    assert plan.plan.feasible and plan.plan.params["recompute"] == "memory"
    assert len(plan.decisions) == 2 * DEPTH + 1     # DEPTH GELUs, DEPTH + 1 addmm


def test_graphs_hold_the_planned_offloads_and_recomputes(trained):
    plan, graphs = trained[0], trained[1]
    forward, backward = graphs["forward"], graphs["backward"]
    offloaded = {k for k, v in plan.decisions.items() if v == "offload"}
    recomputed = {k for k, v in plan.decisions.items() if v == "recompute"}
    got = offloaded_keys(forward)
    assert sorted(got) == sorted(offloaded)            # one offload each, no other
    reloads = device_puts(backward)
    assert sorted(p.name for p in reloads) == sorted(
        p.name.replace("cpu_offload_", "gpu_reload_") for p in device_puts(forward))
    # recomputed: not among the forward's outputs (not saved), run again in the backward
    keys = region_keys(forward)
    saved = {keys.get(n) for n in forward.graph.find_nodes(op="output")[0].args[0]}
    assert not recomputed & saved and not offloaded & saved   # what leaves is the copy
    assert len([n for n in backward.graph.nodes
                if n.target is torch.ops.aten.gelu.default]) == len(recomputed) == 2


def test_losses_and_weights_bit_identical_to_in_core_compile(trained):
    _, _, model, reference, losses, in_core = trained
    assert losses == in_core
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


class Breaks(torch.nn.Module):
    """The test MLP with a graph break in its forward (as transformers' logger calls are)."""

    def __init__(self):
        super().__init__()
        self.mlp = mlp()

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.mlp(x)


def test_a_region_run_eagerly_is_said_once_and_counted():
    """A graph break inside the region makes torch.compile run it eagerly, where selective
    checkpointing recomputes what the plan offloads. Before: nothing said, nothing counted
    (seen with Hugging Face GPT-2 given labels)."""
    x, y = data()
    model = Breaks()
    plan = vtorch.policy(model, (x, y), loss_fn=LOSS, budget=budget_of(model.mlp), link_gbps=6)
    assert plan.stats()["offload"] == 2
    with pytest.warns(UserWarning, match="the checkpointed region runs eagerly") as said:
        train(vtorch.compile_out_of_core(model, plan, backend="aot_eager"), x, y)
    assert len([w for w in said if "runs eagerly" in str(w.message)]) == 1
    assert plan.stats()["offloads_run_eagerly"] == 2


def test_a_second_plan_is_compiled_not_the_first_reused():
    """Two plans compiled in one process with one backend: the second's graphs follow the
    second. Before: torch.compile's cache (keyed on the region's code, guarded on nothing of
    the plan) ran the first plan's graphs, the second never asked (seen with GPT-2)."""
    x, y = data()
    graphs, puts = {}, []
    backend = capturing(graphs)
    for budget in (budget_of(mlp()), "8GiB", budget_of(mlp())):
        model = mlp()
        plan = vtorch.policy(model, (x, y), loss_fn=LOSS, budget=budget, link_gbps=6)
        graphs.clear()
        LOSS(vtorch.compile_out_of_core(model, plan, backend=backend)(x), y).backward()
        puts.append(len(device_puts(graphs["forward"])) if "forward" in graphs else None)
    assert puts == [2, 0, 2]


def test_link_speed_changes_the_plan():
    x, y = data()
    model = mlp()
    fast = vtorch.policy(model, (x, y), loss_fn=LOSS, budget=budget_of(model), link_gbps=1000)
    # A link as fast as memory: copying beats recomputing every time.
    assert {k: fast.stats()[k] for k in ("save", "recompute", "offload")} == \
        {"save": 5, "recompute": 0, "offload": 4}
    assert fast.link_gbps == 1000.0


def test_in_core_budget_saves_everything():
    x, y = data()
    plan = vtorch.policy(mlp(), (x, y), loss_fn=LOSS, budget="8GiB", link_gbps=12)
    assert set(plan.decisions.values()) == {"save"}
    assert plan.stats()["save"] == 2 * DEPTH + 1


def test_default_link_on_cpu_is_the_documented_constant():
    if torch.cuda.is_available():
        pytest.skip("with CUDA the link is measured")
    x, y = data()
    assert vtorch.policy(mlp(1), (x, y), loss_fn=LOSS, budget="8GiB").link_gbps == CPU_LINK_GBPS


def test_unmatched_ops_are_said_once_and_saved():
    x, y = data()
    plan = vtorch.policy(mlp(), (x, y), loss_fn=LOSS, budget=budget_of(mlp()), link_gbps=12)
    other = mlp(DEPTH + 2)           # two more layers than the plan was made for
    from torch.utils.checkpoint import checkpoint
    # eager checkpointing (said too: it recomputes the planned offloads)
    with pytest.warns(UserWarning, match="runs eagerly"), \
            pytest.warns(UserWarning, match="not in the recorded forward") as said:
        out = checkpoint(other, x, use_reentrant=False, context_fn=plan.context_fn)
        LOSS(out, y).backward()
    assert len([w for w in said if "recorded forward" in str(w.message)]) == 1
    # addmm 5 and 6, gelu 4 and 5 have no decision
    assert plan.stats()["unmatched_ops"] == 4


def test_policy_function_answers():
    from torch.utils.checkpoint import CheckpointPolicy as P
    x, y = data()
    plan = vtorch.policy(mlp(), (x, y), loss_fn=LOSS, budget=budget_of(mlp()), link_gbps=12)

    class Ctx:
        is_recompute = False
    decide = plan.policy_fn()
    aten = torch.ops.aten
    expected = {"offload": P.MUST_CPU_OFFLOAD, "recompute": P.MUST_RECOMPUTE,
                "save": P.MUST_SAVE}
    for k in range(DEPTH + 1):
        assert decide(Ctx, aten.addmm.default) == \
            expected[plan.decisions[("aten.addmm.default", k)]]
        if k < DEPTH:
            assert decide(Ctx, aten.gelu.default) == \
                expected[plan.decisions[("aten.gelu.default", k)]]
    assert decide(Ctx, aten.t.default) == P.PREFER_RECOMPUTE      # a view
    # a planned recompute of a seeded-random op is refused: saved
    plan.decisions[("aten.native_dropout.default", 0)] = "recompute"
    assert decide(Ctx, aten.native_dropout.default) == P.MUST_SAVE
    assert plan.stats()["recompute_refused"] == 1
    # a planned offload of a multi-output op is refused: saved
    plan.decisions[("aten.native_layer_norm.default", 0)] = "offload"
    assert decide(Ctx, aten.native_layer_norm.default) == P.MUST_SAVE
    assert plan.stats()["offload_refused"] == 1


def test_no_plan_fits_said_once_or_raised_under_strict():
    x, y = data()
    with pytest.warns(UserWarning, match="no plan fits the budget of 1000 bytes"):
        plan = vtorch.policy(mlp(1), (x, y), loss_fn=LOSS, budget=1000, link_gbps=12)
    assert plan.decisions == {} and not plan.mapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # nothing more is said: already said
        from torch.utils.checkpoint import checkpoint
        checkpoint(mlp(1), x, use_reentrant=False, context_fn=plan.context_fn)
    with pytest.raises(ScheduleError, match="no plan fits the budget"):
        vtorch.policy(mlp(1), (x, y), loss_fn=LOSS, budget=1000, link_gbps=12, strict=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": None}, "budget is required"),
    ({"budget": "1GiB", "link_gbps": 0}, "link_gbps must be positive"),
    ({"budget": "1GiB", "link_gbps": float("nan")}, "link_gbps must be positive"),
])
def test_bad_arguments_refused(kwargs, message):
    x, y = data()
    with pytest.raises(InvalidArgumentError, match=message):
        vtorch.policy(mlp(1), (x, y), loss_fn=LOSS, **kwargs)


def test_not_a_module_refused():
    with pytest.raises(InvalidArgumentError, match="torch.nn.Module"):
        vtorch.policy(lambda x: x, torch.zeros(2), budget="1GiB")
    with pytest.raises(InvalidArgumentError, match="CompilePolicy"):
        vtorch.compile_out_of_core(mlp(1), object())


class ReadsAValue(torch.nn.Module):
    """A forward with a data-dependent branch that never asks whether it is traced (Hugging
    Face's mask code asks, and is recorded: test_torch_compile_hf.py)."""

    def __init__(self, masked=False):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, 10)
        self.masked = masked

    def forward(self, x):
        if self.masked:
            return self.lin(x)[x[:, :10] > 0]         # a shape that depends on values
        if (x[:, -1] == 0).all():
            x = x + 1
        return self.lin(x)


@pytest.mark.parametrize("masked, what", [
    (False, "reads a tensor's value"),
    (True, "makes a tensor whose shape depends on values")])
def test_a_forward_that_reads_a_value_is_refused_by_name(masked, what):
    """Recorded on FakeTensors, as torch.compile traces: such a forward has no value to read
    there either (and torch.compile would break its graph inside the region). Before the
    FakeTensor recording: refused on meta, with Hugging Face GPT-2 among the refused."""
    x, y = data()
    loss = (lambda out, y: out.sum()) if masked else LOSS
    with pytest.raises(InvalidArgumentError, match="records one training iteration on "
                       f"FakeTensors of the meta device.*{what}.*vmalloc.torch.out_of_core") \
            as info:
        vtorch.policy(ReadsAValue(masked), (x, y), loss_fn=loss, budget="1GiB")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert type(info.value.__cause__).__name__ == ("DynamicOutputShapeException" if masked
                                                   else "DataDependentOutputException")


_LIBRARY = torch.library.Library("vmalloc_test_compile", "DEF")
_LIBRARY.define("twice(Tensor x) -> Tensor")
_LIBRARY.impl("twice", lambda x: x * 2, "CPU")          # no fake (meta) kernel


class CustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, 10)

    def forward(self, x):
        return self.lin(torch.ops.vmalloc_test_compile.twice(x))


def test_an_op_without_a_fake_kernel_is_refused_by_name():
    """Before: refused as a forward that reads a value (the meta error said "Meta backend")."""
    x, y = data()
    with pytest.raises(InvalidArgumentError, match="runs an op they cannot run .*"
                       "vmalloc_test_compile.twice.*torch.library.register_fake") as info:
        vtorch.policy(CustomOp(), (x, y), loss_fn=LOSS, budget="1GiB")
    assert type(info.value.__cause__).__name__ == "UnsupportedOperatorException"


def test_offload_mark_keeps_the_configured_joint_pass():
    from torch.utils.checkpoint import CheckpointPolicy as P
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    relu, tanh = [n for n in gm.graph.nodes if n.op == "call_module"]
    relu.meta["recompute"] = P.MUST_CPU_OFFLOAD
    tanh.meta["recompute"] = P.MUST_RECOMPUTE
    calls = []
    assert _mark_offloads(lambda g, i: calls.append(g) or g, gm, ()) is gm
    assert calls == [gm]
    assert relu.meta["should_offload"] and relu.meta["recompute"] == P.MUST_SAVE
    assert "should_offload" not in tanh.meta and tanh.meta["recompute"] == P.MUST_RECOMPUTE
    config = vtorch.offloading_config(7.5)
    assert config["enable_activation_offloading"] is True
    assert config["activation_offload_cpu_gpu_bw"] == 7.5
    assert config["joint_custom_pass"].args == (functorch_config.joint_custom_pass,)


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention and a GELU MLP, each with a residual."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        a = self.ln1(x)
        x = x + self.attn(a, a, a, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def test_transformer_blocks_offload_and_match_in_core():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    reference = torch.nn.Sequential(Block(), Block())
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 64, 64, generator=g), torch.randn(16, 64, 64, generator=g)
    loss_fn = torch.nn.functional.mse_loss
    params = sum(p.numel() * 4 for p in model.parameters())
    plan = vtorch.policy(model, (x, y), loss_fn=loss_fn, budget=3 * params + 20 * x.nbytes,
                         link_gbps=12)
    graphs = {}
    compiled = vtorch.compile_out_of_core(model, plan, backend=capturing(graphs))

    def run(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=False)
        losses = []
        for _ in range(2):
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    # Recorded on meta, attention is the math path (bmm, softmax); on CPU it is one flash
    # attention op: that op has no decision (said once, saved), the others keep theirs.
    with pytest.warns(UserWarning, match="_scaled_dot_product_flash_attention_for_cpu"):
        losses = run(compiled)
    assert losses == run(torch.compile(reference, backend="aot_eager"))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    stats = plan.stats()
    assert (stats["offload"], stats["unmatched_ops"], stats["offload_refused"]) == (16, 2, 3)
    offloaded = {k for k, v in plan.decisions.items() if v == "offload"}
    got = offloaded_keys(graphs["forward"])
    # the offloads of saved activations (clone: the attention's q/k/v; a residual add; the
    # MLP's first linear and GELU) land; the math-path ones (softmax, scaling) do not exist
    assert sorted(got) == [("aten.add.Tensor", 1), ("aten.addmm.default", 1),
                           ("aten.clone.default", 0), ("aten.clone.default", 1),
                           ("aten.clone.default", 2), ("aten.clone.default", 3),
                           ("aten.gelu.default", 0)]
    assert set(got) <= offloaded
    assert sorted(p.name for p in device_puts(graphs["backward"])) == sorted(
        p.name.replace("cpu_offload_", "gpu_reload_") for p in device_puts(graphs["forward"]))

def test_example_runs():
    """examples/torch_compile_out_of_core.py runs on CPU and finds what the tests find."""
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_compile_out_of_core.py")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ),
                          cwd=str(ROOT.parent))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "forward graph: 2 offload(s); backward graph: 2 reload(s), 2 gelu recomputed" \
        in done.stdout
    assert "weights bit-identical: True" in done.stdout


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.sampled_from([32, 64]), st.floats(0.1, 1.0),
       st.sampled_from([0.5, 12.0, 1000.0]))
def test_decisions_follow_the_schedule(depth, width, fraction, link):
    """Whatever the network, budget and link: one decision per forward function, and each is
    what the chosen schedule does with the activation the function creates."""
    model = mlp(depth, width)
    x, y = torch.randn(256, width), torch.randint(0, 10, (256,))
    params = sum(p.numel() * 4 for p in model.parameters())
    budget = 3 * params + int(fraction * 256 * width * 4 * 2 * depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # an infeasible budget is said: not tested here
        plan = vtorch.policy(model, (x, y), loss_fn=LOSS, budget=budget, link_gbps=link)
    if not plan.plan.feasible:
        assert plan.decisions == {} and not plan.mapped
        return
    seq, sched = plan.sequence, plan.plan.schedule
    n = 2 * depth + 1
    assert sorted(plan.decisions) == sorted(
        [("aten.addmm.default", i) for i in range(depth + 1)] +
        [("aten.gelu.default", i) for i in range(depth)])
    rc = sched.recompute
    turn = n if rc is None else rc.index[n]
    out_fw = {v for s in sched.steps[:turn] for v in s.swap_out}
    in_bw = {v for s in sched.steps[turn:] for v in s.swap_in}
    recomputed = set(rc.variables) if rc is not None else set()
    seen = {}
    for f in seq.functions[:n]:
        index = seen.get(f.name, 0)
        seen[f.name] = index + 1
        (v,) = [v for v in f.outputs if v not in f.inputs]      # each creates one activation
        expected = ("recompute" if v in recomputed else
                    "offload" if v in out_fw and v in in_bw else "save")
        assert plan.decisions[(f.name, index)] == expected
    stats = plan.stats()
    assert stats["save"] + stats["recompute"] + stats["offload"] == n
