"""Recompute executed by the Runtime (issue 16 item 2): a buffer the schedule recomputes is
dropped (its chunks unmapped, no copy) and recomputed by re-running its function's ``rerun``;
results stay bit-identical, fewer bytes move, and a program that departs from its record still
reads the right bytes (the dropped buffer is recomputed before its inputs change or go).

VMALLOC_CHECKED=1 (tests/conftest.py): any read of a dropped buffer's memory faults."""

import ctypes
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import vmalloc
from vmalloc.errors import InvalidArgumentError
from vmalloc.offload import Runtime
from vmalloc.frameworks.numpy_training import compare, train
from vmalloc.offload.runtime.recompute import RecomputeError

MiB = 1 << 20
N = 4 * MiB // 4          # float32 elements of one buffer: two 2 MiB chunks
FILLERS = 20              # functions between the producer and the last read (> MIN_GAP)


def runtime(capacity="64MiB", budget=None, recompute=True, **kw):
    dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB")
    return Runtime(alloc, budget=budget, recompute=recompute, **kw)


def arr(p, buf):
    raw = (ctypes.c_char * buf.nbytes).from_address(p[buf])
    return np.ndarray((buf.nbytes // 4,), np.float32, buffer=raw)


class Program:
    """x (loaded) -> a = 2x + 1 (recomputable) -> FILLERS functions over fresh buffers -> the
    result a + x. ``diverge``: what the program does differently after a is dropped, in one
    iteration: "mutate" (writes x in place), "free" (frees x before the read, reading a
    alone), "exit" (leaves the iteration with a still dropped)."""

    def __init__(self, rt, fillers=FILLERS):
        self.rt = rt
        self.fillers = fillers
        self.reruns = 0
        self.break_rerun = False
        self.ready = True      # what produce's rerun says of itself (``ready()``)

    def iteration(self, seed, diverge=None):
        rt = self.rt
        data = np.arange(N, dtype=np.float32) * np.float32(seed + 1)
        x = rt.allocate(N * 4)

        def load(p):
            arr(p, x)[...] = data
        rt.call(load, writes=[x], name="load")
        a = rt.allocate(N * 4)

        calls = []

        def produce(p):
            calls.append(1)
            if self.break_rerun and len(calls) > 1:
                raise ValueError("rerun broke")
            self.reruns += 1
            arr(p, a)[...] = arr(p, x) * np.float32(2) + np.float32(1)
        produce.ready = lambda: self.ready
        rt.call(produce, reads=[x], writes=[a], name="produce")
        expect_x = data.copy()
        for j in range(self.fillers):
            t = rt.allocate(N * 4)
            with rt.function(writes=[t], name="fill") as p:
                arr(p, t)[...] = j
            with rt.function(reads=[t], name="use") as p:
                assert arr(p, t)[7] == j
            rt.deallocate(t)
            if diverge == "mutate" and j == self.fillers - 2:
                with rt.function(reads=[x], writes=[x], name="mutate") as p:
                    arr(p, x)[...] += np.float32(5)
                expect_x += np.float32(5)
        expect_a = data * np.float32(2) + np.float32(1)
        if diverge == "free":
            rt.deallocate(x)
            with rt.function(reads=[a], name="result") as p:
                got = arr(p, a).copy()
            rt.deallocate(a)
            return got, expect_a
        if diverge == "exit":
            return a, x, expect_a, expect_x
        out = np.empty(N, np.float32)
        with rt.function(reads=[a, x], name="result") as p:
            out[...] = arr(p, a) + arr(p, x)
        rt.deallocate(a)
        rt.deallocate(x)
        return out, expect_a + expect_x


def run_scheduled(rt, prog, iterations=3):
    for i in range(iterations):
        with rt.iteration():
            got, want = prog.iteration(i)
        np.testing.assert_array_equal(got, want)


def test_a_dropped_buffer_is_recomputed_and_nothing_moves():
    # Budget 2.5 buffers: x, a and a filler do not fit. Swap-only moves a and x out and back;
    # recompute drops a and re-runs produce: a never crosses the link.
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=3)
    assert rt.schedule.recompute is not None
    assert rt.schedule.recomputed_functions() == 1
    st_ = rt.stats()
    assert st_["scheduled_iterations"] == 2
    assert st_["recompute_drops"] == 2
    assert st_["recomputed_functions"] == 2
    assert prog.reruns == 3 + 2            # once per iteration, again in each scheduled one
    # nothing goes out: a is dropped, and x's swap-out is cancelled before it is waited for
    # (each filler's buffer takes the budget at its own function, when x and it fit)
    assert st_["scheduled_swap_outs"] == 0
    assert st_["peak_device_bytes"] <= 10 * MiB
    base = runtime(budget=10 * MiB, recompute=False)
    run_scheduled(base, Program(base), iterations=3)
    assert base.stats()["scheduled_swap_outs"] == 2           # a, once per scheduled iteration
    assert base.stats()["swapped_out_bytes"] - st_["swapped_out_bytes"] == 2 * N * 4
    assert base.stats()["recomputed_functions"] == 0


def test_no_recompute_when_nothing_needs_to_move():
    # A window (the budget) wider than the fillers: the plain plan moves nothing.
    rt = runtime(capacity="256MiB", budget=None)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=2)
    assert rt.schedule.recompute is None
    assert rt.stats()["recompute_drops"] == 0


def test_write_to_an_input_recomputes_first():
    # Iteration 3 writes x while a is dropped: a must be recomputed from the old x first.
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=2)
    with rt.iteration():
        got, want = prog.iteration(7, diverge="mutate")
    np.testing.assert_array_equal(got, want)
    assert rt.stats()["recomputed_functions"] == 2   # the on-demand recompute, before mutate
    assert rt.stats()["diverged_iterations"] == 1


def test_free_of_an_input_recomputes_first():
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=2)
    with rt.iteration():
        got, want = prog.iteration(3, diverge="free")
    np.testing.assert_array_equal(got, want)
    assert rt.stats()["recomputed_functions"] == 2


def test_leaving_the_region_recomputes_what_is_dropped():
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=2)
    with pytest.raises(KeyError):
        with rt:
            rt.begin_iteration()
            a, x, want_a, _ = prog.iteration(4, diverge="exit")
            assert a.state == "dropped"
            raise KeyError("the program fails with a dropped")
    assert a.state == "resident"
    with rt.function(reads=[a], name="after") as p:
        np.testing.assert_array_equal(arr(p, a), want_a)


def test_a_failing_rerun_is_named():
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=2)
    prog.break_rerun = True     # produce works once per iteration, then raises
    with pytest.raises(RecomputeError, match=r"buffer \d+ could not be recomputed.*rerun broke"):
        with rt.iteration():
            prog.iteration(5)


def test_a_scheduled_recompute_that_fails_once_loses_nothing():
    # Issue 20: the rerun raising once left a "resident" holding another buffer's old bytes.
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    run_scheduled(rt, prog, iterations=2)
    rt.begin_iteration()
    a, x, want_a, want_x = prog.iteration(4, diverge="exit")
    rt.end_iteration()
    assert a.state == "dropped"
    prog.break_rerun = True
    with pytest.raises(RecomputeError) as info:
        rt.restore_all()
    assert a.state == "dropped" and x.state == "resident"    # a was "resident", wrong bytes
    assert str(info.value).startswith(f"buffer {a.id} could not be recomputed: running its "
                                      f"function's rerun raised ValueError('rerun broke'); "
                                      f"it stays dropped")
    prog.break_rerun = False
    with rt.function(reads=[a, x], name="after") as p:
        np.testing.assert_array_equal(arr(p, a), want_a)
        np.testing.assert_array_equal(arr(p, x), want_x)
    assert a.state == "resident"


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError, match="recompute must be True or False"):
        runtime(recompute="yes")
    rt = runtime()
    buf = rt.allocate(MiB)
    with pytest.raises(InvalidArgumentError, match="rerun must be callable"):
        rt.enter_function(reads=[buf], rerun=42)
    assert not rt.in_function
    with pytest.raises(InvalidArgumentError, match="set_rerun is for the running function"):
        rt.set_rerun(lambda p: None)


@pytest.mark.parametrize("network,gpu,args", [
    # 4 MiB activations: moving one over the V100's NVLink (2 x 45.9 GB/s) takes longer than
    # re-running its function (135 us of launch overhead in the model)
    ("mlp", "v100-16gb", dict(batch=8192, sizes=(128,) * 10 + (10,))),
    # 2 MiB ones pay on the A100's PCIe 4 link (25 GB/s), not on the V100's
    ("cnn", "a100-40gb", dict(batch=128, channels=(3,) + (16,) * 6, size=16)),
])
def test_numpy_training_bit_identical_with_recompute(network, gpu, args):
    def make(capacity, recompute):
        dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
        alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB", small_threshold=64 << 10)
        return Runtime(alloc, scheduler="window" if capacity != "1GiB" else "none",
                       recompute=recompute, gpu=gpu)

    ref = train(make("1GiB", False), network, steps=3, **args)
    peak = ref.stats["peak_device_bytes"]
    capacity = peak // 2 // (2 << 20) * (2 << 20)
    swap = make(capacity, False)
    swap_only = train(swap, network, steps=3, **args)
    rt = make(capacity, True)
    out = train(rt, network, steps=3, **args)
    assert out.losses == ref.losses and out.weights == ref.weights
    assert swap_only.losses == ref.losses and swap_only.weights == ref.weights
    st_ = out.stats
    assert rt.schedule.recompute is not None
    assert st_["recomputed_functions"] == (st_["scheduled_iterations"]
                                           * rt.schedule.recomputed_functions()) > 0
    assert st_["swapped_out_bytes"] < swap_only.stats["swapped_out_bytes"]
    assert st_["diverged_iterations"] == 0


def test_compare_reports_recompute():
    r = compare("mlp", steps=3, fraction=0.5, recompute=True)
    assert r["identical"]


@settings(max_examples=15, deadline=None)
@given(fillers=st.integers(0, 24), budget_mib=st.sampled_from([8, 10, 12, 16, 64]),
       diverge=st.sampled_from([None, "mutate", "free"]), at=st.integers(1, 3))
def test_recompute_never_loses_data(fillers, budget_mib, diverge, at):
    """Random gaps, budgets and departures from the record: the result is always the NumPy
    reference, and never more bytes move than without recompute."""
    def run(recompute):
        rt = runtime(capacity="32MiB", budget=budget_mib * MiB, recompute=recompute)
        prog = Program(rt, fillers=fillers)
        for i in range(4):
            with rt.iteration():
                got, want = prog.iteration(i, diverge=diverge if i == at else None)
            np.testing.assert_array_equal(got, want)
        return rt.stats()
    with_rc, without = run(True), run(False)
    assert with_rc["swapped_out_bytes"] <= without["swapped_out_bytes"]


def test_recompute_and_compression_together():
    """Both choices at once: what is recomputed never crosses the link, what still swaps goes
    at half its bytes; fewer bytes than either alone, and the losses stay within fp16's
    rounding of the in-core run."""
    net = dict(network="mlp", batch=8192, sizes=(128,) * 10 + (10,), steps=3)

    def make(capacity, **kw):
        dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
        alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB", small_threshold=64 << 10)
        return Runtime(alloc, **kw)

    ref = train(make("1GiB", scheduler="none"), **net)
    capacity = ref.stats["peak_device_bytes"] // 2 // (2 << 20) * (2 << 20)
    out = {}
    for name, kw in (("recompute", dict(recompute=True)), ("compress", dict(compress="fp16")),
                     ("both", dict(recompute=True, compress="fp16"))):
        out[name] = train(make(capacity, **kw), **net)
    both = out["both"].stats
    assert both["recomputed_functions"] > 0 and both["compressed_swap_outs"] > 0
    assert both["swapped_out_bytes"] < min(out["recompute"].stats["swapped_out_bytes"],
                                           out["compress"].stats["swapped_out_bytes"])
    assert out["recompute"].losses == ref.losses
    assert max(abs(a - b) / b for a, b in zip(out["both"].losses, ref.losses)) < 1e-5


# --- issue 20, item 5: recompute=True says why it recomputes nothing, once ---------------------
# (a warning at the program's line and stats()["recompute_reason"]; None when it recomputes, or
# when recompute is off). Before, an MLP, a CNN and a transformer recomputed nothing silently.


def said_recompute(said):
    return [w for w in said if "recomputes nothing" in str(w.message)]


def test_no_reason_when_it_recomputes():
    rt = runtime(budget=10 * MiB)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_scheduled(rt, Program(rt))
    assert rt.stats()["recompute_drops"] == 2
    assert rt.stats()["recompute_reason"] is None and said_recompute(said) == []


def test_no_reason_when_recompute_is_off():
    rt = runtime(budget=10 * MiB, recompute=False)
    run_scheduled(rt, Program(rt))
    assert rt.stats()["recompute_reason"] is None


def test_no_budget_pressure_is_said_once_at_the_programs_line():
    rt = runtime(capacity="256MiB", budget=None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_scheduled(rt, Program(rt), iterations=3)
    assert rt.stats()["recompute_reason"] == "no budget pressure: nothing is swapped"
    [w] = said_recompute(said)
    assert (w.category, w.filename) == (UserWarning, __file__)   # run_scheduled's `with`
    assert str(w.message) == ("recompute=True recomputes nothing: no budget pressure: nothing "
                              "is swapped")


def test_no_function_with_a_rerun():
    rt = runtime(budget=10 * MiB)

    def call(fn, reads=(), writes=(), name=None):   # as rt.call, but with no rerun
        with rt.function(reads=reads, writes=writes, name=name) as p:
            return fn(p)
    rt.call = call
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_scheduled(rt, Program(rt))
    reason = "no function with a rerun (Runtime.call, or enter_function's rerun)"
    assert rt.stats()["recompute_reason"] == reason
    assert rt.stats()["recompute_drops"] == 0
    assert [str(w.message) for w in said_recompute(said)] == [
        f"recompute=True recomputes nothing: {reason}"]


def test_the_warning_points_at_the_with_line():
    rt = runtime(capacity="256MiB", budget=None)
    prog = Program(rt)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with rt.iteration():
            got, want = prog.iteration(0)
        line = sys._getframe().f_lineno - 2
    np.testing.assert_array_equal(got, want)
    [w] = said_recompute(said)
    assert (w.filename, w.lineno) == (__file__, line)


def test_a_plan_whose_drops_are_refused_is_made_again_without_them():
    # produce's rerun says it cannot run (a driver's rerun whose input is gone): the planned
    # drop of a is refused, a stays resident over a plan that counted it freed. Before, every
    # scheduled iteration refused it again, silently (recomputed_functions 0, no reason), and
    # the budget was kept by evictions on demand. Now the plan is made again without a, said
    # once, and the next iterations follow the swap-only plan.
    rt = runtime(budget=10 * MiB)
    prog = Program(rt)
    prog.ready = False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_scheduled(rt, prog, iterations=4)
    st_ = rt.stats()
    reason = ("1 planned drop(s) could not be followed (its function's rerun cannot run (an "
              "input or its output is gone)): planned again without them")
    assert st_["recompute_refused"] == 1 and st_["recompute_drops"] == 0
    assert st_["recomputed_functions"] == 0
    assert st_["recompute_reason"] == reason
    told = [str(w.message) for w in said if "recompute" in str(w.message)]
    assert told == [f"recompute=True recomputes nothing: {reason}"]
    assert rt.schedule.recompute is None and st_["reschedules"] == 1
    # the last two iterations follow the swap-only plan exactly as a runtime without recompute
    base = runtime(budget=10 * MiB, recompute=False)
    run_scheduled(base, Program(base), iterations=4)
    b = base.stats()
    assert st_["scheduled_iterations"] == b["scheduled_iterations"] == 3
    assert b["on_demand_swap_ins"] == b["evictions"] == 1   # (the recording's)
    # iteration 1 kept a resident (1 swap-in fewer, a not swapped out) over a plan that keeps x
    # too (its swap-out cancelled): the budget was kept by one eviction and one swap-in on
    # demand; 2 and 3 as the base
    assert st_["on_demand_swap_ins"] == st_["evictions"] == 2
    assert b["scheduled_swap_ins"] - st_["scheduled_swap_ins"] == 1
    assert b["swapped_out_bytes"] == st_["swapped_out_bytes"]
