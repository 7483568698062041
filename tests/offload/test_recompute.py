"""Recompute and compression as scheduling choices: the checker's rules, the simulator's
charges, and properties over random networks (never more bytes than swap-only, never over the
budget)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmalloc.offload import FunctionSequence, InCoreScheduler, ScheduleError, simulate
from vmalloc.offload.hardware.gpus import get_gpu
from vmalloc.offload.planning.planner import plan, schedule_with_choices
from vmalloc.offload.scheduling.recompute import (MIN_GAP, compressible, recompute_candidates,
                                       with_recompute)

MiB = 1 << 20
GB = 10 ** 9
# a toy GPU: 1 GB/s link, 100 GB/s HBM, no overhead: a 1 MB ReLU costs 20 us, moving it 2 ms
TOY = get_gpu("v100-16gb").with_(name="toy", h2d_bandwidth=1 * GB, d2h_bandwidth=1 * GB,
                                 bidirectional_bandwidth=1 * GB, hbm_bandwidth=100 * GB,
                                 function_overhead_seconds=0.0, memory_bytes=1 << 30)


def network(sizes, relu=True, seconds=None):
    """A forward/backward chain: layer k reads a_(k-1) and w_k, writes c_k (a convolution,
    compute-bound); an in-place-free BatchNorm-like b_k = bn(c_k) and ReLU r_k = relu_(b_k)
    (memory-bound); the backward reads r_k (conv k+1's input), c_k (the BatchNorm's)."""
    seq = FunctionSequence(name="net", batch=1)
    x = seq.add_variable(sizes[0], name="x", per_sample_bytes=sizes[0])
    prev = x
    layers = []
    seq.add_function([], [x], name="input", seconds=1e-4)
    for k, n in enumerate(sizes):
        w = seq.add_variable(MiB, persistent=True, name=f"w{k}")
        c = seq.add_variable(n, name=f"c{k}", per_sample_bytes=n)
        b = seq.add_variable(n, name=f"b{k}", per_sample_bytes=n)
        seq.add_function([prev, w], [c], flops=1e12, name="aten.convolution.default")
        seq.add_function([c], [b], flops=0.0, name="aten.native_batch_norm.default",
                         seconds=seconds)
        if relu:
            seq.add_function([b], [b], flops=0.0, name="aten.relu_.default", seconds=seconds)
        layers.append((prev, w, c, b))
        prev = b
    g = seq.add_variable(sizes[-1], name="g")
    seq.add_function([prev], [g], name="loss", seconds=1e-4)
    for k in reversed(range(len(sizes))):
        inp, w, c, b = layers[k]
        gw = seq.add_variable(MiB, name=f"gw{k}")
        gi = seq.add_variable(seq.nbytes(inp), name=f"g{k}")
        seq.add_function([g, b], [g], flops=0.0, name="aten.threshold_backward.default")
        seq.add_function([g, c], [g], flops=0.0, name="aten.native_batch_norm_backward")
        seq.add_function([g, inp, w], [gi, gw], flops=2e12, name="aten.convolution_backward")
        seq.add_function([w, gw], [w], flops=0.0, name="sgd")
        g = gi
    return seq


def test_candidates_are_memory_bound_chains_and_expansion_renames_later_reads():
    seq = network([8 * MiB] * 12)
    vs = recompute_candidates(seq, TOY)
    names = {seq.variables[v].name for v in vs}
    # BatchNorm+ReLU outputs far from their backward use; never a convolution output (the
    # BatchNorm's own input: needed anyway), never a persistent weight
    assert names and all(n.startswith("b") for n in names)
    rc = with_recompute(seq, vs)
    ex = rc.sequence
    assert len(ex.functions) == len(seq.functions) + 2 * len(vs)     # bn + relu_ per variable
    assert {ex.functions[k].name for k in rc.origin} == {
        "recompute:aten.native_batch_norm.default", "recompute:aten.relu_.default"}
    for w, v in rc.clones.items():
        u = ex.uses()[v]
        # the original is not used after its long gap; the clone takes every later use
        assert all(b - a < MIN_GAP for a, b in zip(u, u[1:]))
        assert ex.uses()[w][0] in rc.origin
    s = InCoreScheduler().schedule(ex)
    s.recompute = rc
    assert s.check(seq) > 0
    assert s.recomputed_functions() == 2 * len(vs)


def test_checker_refuses_a_recompute_whose_input_changed_or_is_not_resident():
    seq = network([8 * MiB] * 12)
    vs = recompute_candidates(seq, TOY)
    rc = with_recompute(seq, vs)
    ex = rc.sequence
    k = min(rc.origin)                 # the first re-run: a BatchNorm reading some c_j
    g = ex.functions[k]
    c = g.inputs[0]
    # an input written between the original and the re-run: the recompute would differ
    bad = FunctionSequence(name="bad", batch=1)
    for v in ex.variables:
        bad.add_variable(v.nbytes, persistent=v.persistent, name=v.name)
    for i, f in enumerate(ex.functions):
        outs = f.outputs + ((c,) if i == k - 1 and c not in f.outputs else ())
        bad.add_function(f.inputs, outs, flops=f.flops, seconds=f.seconds, name=f.name)
    rc.sequence = bad
    s = InCoreScheduler().schedule(bad)
    s.recompute = rc
    with pytest.raises(ScheduleError, match="was written since the original ran"):
        s.check(seq)
    # the re-run's input swapped out and not back: the ordinary read rule names it
    rc.sequence = ex
    s = InCoreScheduler().schedule(ex)
    s.recompute = rc
    u = ex.uses()[c]
    before = [j for j in u if j < k][-1]
    s.steps[before].free.remove(c) if c in s.steps[before].free else None
    s.steps[u[-1]].free.remove(c)
    s.steps[before].swap_out.append(c)
    s.steps[before + 1].wait_swap_out.append(c)
    with pytest.raises(ScheduleError, match=f"reads {ex.variables[c].name}.*not resident"):
        s.check(seq)


def test_simulator_charges_recompute_and_compression():
    seq = network([8 * MiB] * 12, seconds=1e-3)
    vs = recompute_candidates(seq, TOY)
    rc = with_recompute(seq, vs)
    s = InCoreScheduler().schedule(rc.sequence)
    s.recompute = rc
    base = simulate(seq, None, gpu=TOY, va_costs=False)
    r = simulate(seq, s, gpu=TOY, va_costs=False)
    assert r.recomputed_functions == 2 * len(vs)
    assert r.recompute_seconds == pytest.approx(2 * len(vs) * 1e-3)
    assert r.in_core_seconds == pytest.approx(base.compute_seconds)
    assert r.iteration_seconds == pytest.approx(base.iteration_seconds + r.recompute_seconds)
    # compression: one 1 GB variable swapped as fp16 moves 0.5 GB (0.5 s at 1 GB/s) plus a
    # cast of 1.5 GB / 100 GB/s = 15 ms on each copy
    one = FunctionSequence(batch=1)
    a = one.add_variable(GB, name="a", per_sample_bytes=GB)
    one.add_function([], [a], seconds=0.1)
    one.add_function([], [], seconds=0.1)
    one.add_function([a], [], seconds=0.1)
    from vmalloc.offload import Schedule, Step
    steps = [Step(allocate=[a], swap_out=[a]), Step(wait_swap_out=[a], swap_in=[a]),
             Step(wait_swap_in=[a], free=[a])]
    plain = simulate(one, Schedule("hand", steps), gpu=TOY, va_costs=False, timeline=True)
    half = Schedule("hand", steps, compressed=frozenset([a]), compression="fp16")
    assert compressible(one) == [a]
    h = simulate(one, half, gpu=TOY, va_costs=False, timeline=True)
    assert h.swapped_out_bytes == GB // 2 and plain.swapped_out_bytes == GB
    d2h = h.timeline["d2h"][0]
    assert d2h[1] - d2h[0] == pytest.approx(0.5 + 0.015)
    assert h.iteration_seconds < plain.iteration_seconds
    assert h.compression == "fp16" and plain.compression is None


@st.composite
def networks(draw):
    sizes = draw(st.lists(st.integers(1, 16).map(lambda m: m * MiB), min_size=2, max_size=14))
    return network(sizes, relu=draw(st.booleans()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(networks(), st.integers(1, 64), st.integers(24, 400), st.sampled_from(["memory", "all"]),
       st.sampled_from([None, "fp16"]))
def test_choices_never_move_more_than_swap_only_and_stay_in_budget(seq, window_mib, budget_mib,
                                                                 recompute, compress):
    params = {"window": window_mib * MiB, "budget": budget_mib * MiB, "drop": True}
    try:
        swap_only = schedule_with_choices(seq, "window", params, TOY)
    except ScheduleError:
        return
    chosen = schedule_with_choices(seq, "window", params, TOY, recompute, compress)
    assert chosen.check(seq, params["budget"]) <= params["budget"]
    moved = chosen.swap_out_bytes(seq) + chosen.swap_in_bytes(seq)
    assert moved <= swap_only.swap_out_bytes(seq) + swap_only.swap_in_bytes(seq)
    r = simulate(seq, chosen, gpu=TOY)
    assert not r.out_of_memory or r.oom_message


def test_plan_considers_recompute_and_it_pays_when_the_link_is_slow():
    seq = network([64 * MiB] * 16)
    g = TOY.with_(memory_bytes=1 << 30)
    p0 = plan(seq, g, "window", "virtual")
    p1 = plan(seq, g, "window", "virtual", recompute=True)
    assert p0.feasible and p1.feasible
    assert p1.result.images_per_second >= p0.result.images_per_second
    assert p1.params.get("recompute") in ("memory", "all")
    assert p1.result.recomputed_functions > 0
    assert (p1.result.swapped_out_bytes + p1.result.swapped_in_bytes
            < p0.result.swapped_out_bytes + p0.result.swapped_in_bytes)


def test_plan_table_counts_each_choice_and_names_the_bottleneck():
    from vmalloc.offload import Schedule, Step
    from vmalloc.offload.planning.plan_report import format_plan, plan_table

    one = FunctionSequence(batch=1)
    a = one.add_variable(GB, name="a", per_sample_bytes=GB)
    w = one.add_variable(MiB, persistent=True, name="w")
    one.add_function([w], [a], seconds=0.1, name="aten.convolution.default")
    one.add_function([], [], seconds=0.1, name="idle")
    one.add_function([a, w], [], seconds=0.1, name="aten.convolution_backward.default")
    steps = [Step(allocate=[a], swap_out=[a]), Step(wait_swap_out=[a], swap_in=[a]),
             Step(wait_swap_in=[a], free=[a])]
    s = Schedule("hand", steps, initial_resident=frozenset([w]), compressed=frozenset([a]),
                 compression="fp16")
    r = simulate(one, s, gpu=TOY, va_costs=False)
    t = plan_table(one, s, r)
    conv = t["classes"]["convolution"]
    assert conv["variables"] == 1 and conv["compress"] == 1 and conv["keep"] == 0
    assert conv["compress_bytes_moved"] == GB          # half out, half in
    par = t["classes"]["parameters and state"]
    assert par["keep"] == 1 and par["swap_bytes_moved"] == 0
    # 0.5 GB each way at 1 GB/s (+ casts) against 0.3 s of compute: the link is the limit
    assert t["bottleneck"] in ("H2D", "D2H")
    text = format_plan(t)
    assert "convolution" in text and "bottleneck" in text and "link" in text
