"""The out-of-core runtime, end to end on the backed emulated device, with real data.

Every tensor of the NumPy programs lives in vmalloc memory; a swapped-out buffer is unmapped
(touching it would fault), so training that is bit-identical to the in-core run proves that
every function found its buffers resident with their bytes intact.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import vmalloc
from vmalloc.errors import InvalidArgumentError, InvalidPointerError
from vmalloc.frameworks import numpy_training as nt
from vmalloc.offload.runtime import Runtime

MiB = 1 << 20

ALLOCATORS = {
    "virtual": lambda dev: vmalloc.VirtualAllocator(dev, chunk_size="2MiB"),
    "packed": lambda dev: vmalloc.VirtualAllocator(dev, placement="packed"),
    "caching": lambda dev: vmalloc.CachingAllocator(dev),
}

MLP = dict(network="mlp", batch=4096, steps=4, sizes=(1024, 1024, 1024, 10), lr=0.01)
CNN = dict(network="cnn", batch=32, steps=4, channels=(3, 16, 16, 16, 16, 16, 32), size=16,
           lr=0.01)


def runtime(kind, capacity, **kw):
    dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
    return Runtime(ALLOCATORS[kind](dev), **kw)


def in_core(config, kind="virtual"):
    rt = runtime(kind, "4GiB", scheduler="none")
    return nt.train(rt, **config), rt


@pytest.fixture(scope="module")
def mlp_reference():
    return in_core(MLP)


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_mlp_trains_bit_identically_under_half_its_in_core_memory(kind, mlp_reference):
    ref, ref_rt = mlp_reference
    peak = ref_rt.stats()["peak_device_bytes"]
    assert ref.stats["swapped_out_bytes"] == 0
    capacity = (peak // 2) // (2 * MiB) * (2 * MiB)
    rt = runtime(kind, capacity)
    out = nt.train(rt, **MLP)
    assert out.losses == ref.losses
    assert out.weights == ref.weights
    stats = rt.stats()
    assert stats["peak_device_bytes"] <= rt.budget < peak / 2
    assert stats["swapped_out_bytes"] > 0 and stats["swapped_in_bytes"] > 0
    assert stats["recorded_iterations"] == 1
    assert stats["scheduled_iterations"] == MLP["steps"] - 1
    assert stats["diverged_iterations"] == 0
    assert stats["scheduled_swap_outs"] > 0


@pytest.mark.parametrize("kind", ["virtual", "packed"])
def test_cnn_trains_bit_identically_under_half_its_in_core_memory(kind):
    """(The caching allocator cannot run it: its 20 MiB segments exceed the capacity.)"""
    ref, ref_rt = in_core(CNN)
    assert ref.losses[-1] < ref.losses[0]      # it learns
    peak = ref_rt.stats()["peak_device_bytes"]
    rt = runtime(kind, (peak // 2) // (2 * MiB) * (2 * MiB))
    out = nt.train(rt, **CNN)
    assert out.losses == ref.losses
    assert out.weights == ref.weights
    stats = rt.stats()
    assert stats["swapped_out_bytes"] > 0
    assert stats["scheduled_iterations"] == CNN["steps"] - 1


def test_pointers_stay_put_on_the_virtual_allocator():
    rt = runtime("virtual", "16MiB")
    bufs = [rt.allocate(4 * MiB) for _ in range(6)]    # 24 MiB > 16 MiB: some must go out
    ptrs = [b.ptr for b in bufs]
    for rounds in range(3):
        for i, b in enumerate(bufs):
            with rt.function(writes=[b]) as p:
                assert p[b] == ptrs[i]
                nt.view(p, b, (MiB,))[...] = i + rounds
    for i, b in enumerate(bufs):
        with rt.function(reads=[b]) as p:
            assert p[0] == ptrs[i]
            assert np.all(nt.view(p, b, (MiB,)) == i + 2)
    assert rt.stats()["evictions"] > 0


def _changed_run(kind, budget_fraction, batches, program):
    """Trains with a program that may differ per step: returns (losses, weights)."""
    ref_rt = runtime(kind, "4GiB", scheduler="none")
    ref = program(ref_rt, batches)
    peak = ref_rt.stats()["peak_device_bytes"]
    rt = runtime(kind, int(peak * budget_fraction) // (2 * MiB) * (2 * MiB))
    out = program(rt, batches)
    return ref, out, rt.stats()


def _mlp_program(extra_steps=(), skip_steps=(), swap_steps=()):
    """An MLP whose step i runs an extra function (longer), skips one (shorter) or runs two
    functions in the other order (reordered)."""

    def program(rt, batches):
        net = nt.MLP(rt, sizes=(512, 512, 512, 10))
        xs, ys = nt.make_data("mlp", max(batches), len(batches), sizes=(512, 512, 512, 10))
        losses = []
        for i, b in enumerate(batches):
            with rt.iteration():
                extra = rt.allocate(4 * MiB)
                scratch = rt.allocate(4 * MiB)
                if i in swap_steps:
                    order = (scratch, extra)
                else:
                    order = (extra, scratch)
                for buf in order:
                    if i in skip_steps and buf is scratch:
                        continue
                    with rt.function(writes=[buf], name=f"fill{buf is extra}") as p:
                        nt.view(p, buf, (MiB,))[...] = 1.0
                if i in extra_steps:
                    with rt.function(reads=[extra], writes=[scratch], name="more") as p:
                        nt.view(p, scratch, (MiB,))[...] = nt.view(p, extra, (MiB,)) * 2
                rt.deallocate(extra)
                rt.deallocate(scratch)
                losses.append(net.step(xs[i, :b], ys[i, :b], 0.01, 0.9))
        return losses, net.weights()

    return program


@pytest.mark.parametrize("change", ["longer", "shorter", "reordered", "larger_batch"])
def test_iterations_that_differ_from_the_record_stay_correct(change):
    batches = [2048] * 5
    program = _mlp_program()
    if change == "longer":
        program = _mlp_program(extra_steps=(2, 3))
    elif change == "shorter":
        program = _mlp_program(skip_steps=(2,))
    elif change == "reordered":
        program = _mlp_program(swap_steps=(2,))
    else:
        batches = [1024] * 2 + [2048] * 3
    ref, out, stats = _changed_run("virtual", 0.5, batches, program)
    assert out == ref
    assert stats["diverged_iterations"] >= 1
    assert stats["reschedules"] >= 1
    assert stats["swapped_out_bytes"] > 0


def test_a_smaller_last_batch_follows_the_schedule():
    """Smaller buffers than recorded keep the schedule (its budget still holds)."""
    ref, out, stats = _changed_run("virtual", 0.5, [2048] * 4 + [1000], _mlp_program())
    assert out == ref
    assert stats["diverged_iterations"] == 0
    assert stats["scheduled_iterations"] == 4


def test_an_iteration_far_longer_than_the_record_survives():
    """nnabla's scheduler indexes its record without a bounds check and crashes here."""
    batches = [2048] * 3
    ref, out, stats = _changed_run("virtual", 0.5, batches, _mlp_program(extra_steps=(1, 2)))
    assert out == ref


def test_bad_calls_raise_and_change_nothing():
    rt = runtime("virtual", "64MiB")
    a = rt.allocate(MiB)
    other = runtime("virtual", "64MiB").allocate(MiB)
    with pytest.raises(InvalidArgumentError, match="not a buffer of this runtime"):
        with rt.function(reads=[other]):
            pass
    with pytest.raises(InvalidArgumentError, match="do not nest"):
        with rt.function(reads=[a]):
            with rt.function(reads=[a]):
                pass
    with pytest.raises(InvalidArgumentError, match="in use by the running function"):
        with rt.function(reads=[a]):
            rt.deallocate(a)
    with pytest.raises(InvalidArgumentError, match="do not nest"):
        with rt.iteration():
            with rt.iteration():
                pass
    with pytest.raises(InvalidArgumentError, match="nbytes must be positive"):
        rt.allocate(0)
    rt.deallocate(a)
    with pytest.raises(InvalidPointerError, match="was deallocated"):
        rt.deallocate(a)
    assert rt.stats()["device_bytes"] == 0


def test_budget_defaults_to_capacity_less_a_margin():
    rt = runtime("virtual", "100MiB")
    assert rt.budget == int(100 * MiB * 0.95)
    assert runtime("virtual", "100MiB", budget="10MiB").budget == 10 * MiB


def test_touching_a_swapped_out_buffer_faults_as_on_a_gpu(tmp_path):
    code = textwrap.dedent("""
        import ctypes, vmalloc
        from vmalloc.offload.runtime import Runtime
        dev = vmalloc.HostDevice(capacity="8MiB", granularity="2MiB")
        rt = Runtime(vmalloc.VirtualAllocator(dev), budget="4MiB")
        a = rt.allocate("4MiB"); b = rt.allocate("4MiB")   # a is evicted for b
        assert a.state == "on_host", a.state
        print("touching", flush=True)
        ctypes.c_char.from_address(a.ptr).value
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path)   # not the repository root: its vmalloc/ is not built
    assert "touching" in proc.stdout, proc.stderr
    assert proc.returncode in (-11, 139), (proc.returncode, proc.stderr)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(ALLOCATORS)))
def test_random_programs_compute_what_they_compute_in_core(data, kind):
    """Random functions over random buffers under a random budget: the bytes every function
    reads are the bytes the in-core run reads."""
    n_persistent = data.draw(st.integers(1, 3))
    sizes = data.draw(st.lists(st.sampled_from([MiB, 2 * MiB, 3 * MiB]), min_size=n_persistent,
                               max_size=n_persistent))
    steps = data.draw(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7),
                                         st.sampled_from(["new", "old"])),
                               min_size=1, max_size=12))
    iterations = data.draw(st.integers(2, 4))

    def program(rt):
        pers = [rt.allocate(s) for s in sizes]
        for k, p in enumerate(pers):
            with rt.function(writes=[p]) as ptrs:
                nt.view(ptrs, p, (p.nbytes // 4,))[...] = k + 1
        sums = []
        for it in range(iterations):
            with rt.iteration():
                live = list(pers)
                for a, b, kind_ in steps:
                    src = live[a % len(live)]
                    if kind_ == "new":
                        dst = rt.allocate(MiB)
                        live.append(dst)
                    else:
                        dst = live[b % len(live)]
                    with rt.function(reads=[src], writes=[dst], name=kind_) as ptrs:
                        s = nt.view(ptrs, src, (MiB // 4,))
                        d = nt.view(ptrs, dst, (MiB // 4,))
                        d[...] = s * 0.5 + (it + 1)
                        sums.append(float(d.sum()))
                for buf in live[len(pers):]:
                    rt.deallocate(buf)
        return sums

    ref = program(runtime(kind, "1GiB", scheduler="none"))
    # A function needs at most 8 MiB: two 3 MiB buffers, each 4 MiB of 2 MiB chunks (6 MiB
    # was too few: such a function could not fit and the runtime said so).
    budget = data.draw(st.integers(8, 16)) * MiB
    rt = runtime(kind, budget + 16 * MiB, budget=budget)
    assert program(rt) == ref
    assert rt.stats()["peak_device_bytes"] <= budget


def test_vmalloc_offload_train_prints_one_json_object(capsys):
    import json

    from vmalloc.cli import main

    assert main(["offload", "train", "--network", "cnn", "--steps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["identical"] is True
    assert r["capacity_bytes"] <= r["in_core_peak_bytes"] // 2
    assert r["in_core_losses"] == r["out_of_core_losses"]
    assert r["stats"]["swapped_out_bytes"] > 0


def test_vmalloc_offload_train_refuses_one_step(capsys):
    from vmalloc.cli import main

    assert main(["offload", "train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--steps must be at least 2" in err and len(err.strip().splitlines()) == 1


def test_keep_free_plans_again_with_room_left_or_changes_nothing(mlp_reference):
    """Runtime.keep_free (the PyTorch driver's replay under pressure asks for it): the window
    schedule is made again for the budget less the margin when one fits, and training stays
    bit-identical under it; a margin no schedule fits changes nothing."""
    from vmalloc.offload.scheduling.schedule import ScheduleError

    ref, ref_rt = mlp_reference
    peak = ref_rt.stats()["peak_device_bytes"]
    capacity = (peak // 2) // (2 * MiB) * (2 * MiB)
    rt = runtime("virtual", capacity)
    nt.train(rt, **MLP)
    schedule, margin = rt._schedule, rt.budget // 16
    with pytest.raises(ScheduleError):      # the plan made for the whole budget fills it
        schedule.check(rt._sequence, rt.budget - margin)
    assert rt.keep_free(margin) is True and rt.schedule_margin == margin
    assert rt._schedule is not schedule
    rt._schedule.check(rt._sequence, rt.budget - margin)     # fits the smaller budget
    kept = rt._schedule
    assert rt.keep_free(rt.budget - 1) is False and rt.schedule_margin == margin
    assert rt._schedule is kept
    assert rt.keep_free(rt.budget) is False and rt.keep_free(0) is False
    assert runtime("virtual", capacity, scheduler="none").keep_free(margin) is False
    # Training planned with the margin from its record on: the same numbers (the recording
    # iteration runs on demand under the whole budget, the margin is the schedule's only).
    rt = runtime("virtual", capacity)
    rt.schedule_margin = margin
    out = nt.train(rt, **MLP)
    assert out.losses == ref.losses and out.weights == ref.weights
    assert rt.stats()["peak_device_bytes"] <= rt.budget
    rt._schedule.check(rt._sequence, rt.budget - margin)


def test_keep_free_schedules_the_record_once(mlp_reference, monkeypatch):
    """keep_free makes the window schedule for the smaller budget once (it used to make it
    twice: once to test the margin, again to plan); a margin no mode fits tries each mode once
    and leaves the plan, the counters and the message as they were, even under strict."""
    import warnings

    from vmalloc.offload.scheduling.window import WindowScheduler

    ref, ref_rt = mlp_reference
    capacity = (ref_rt.stats()["peak_device_bytes"] // 2) // (2 * MiB) * (2 * MiB)
    rt = runtime("virtual", capacity, strict=True)
    nt.train(rt, **MLP)
    made = []
    schedule = WindowScheduler.schedule
    monkeypatch.setattr(WindowScheduler, "schedule", lambda self, seq, trace=None: (
        made.append(self.persistent), schedule(self, seq, trace))[1])
    before = rt.stats()
    assert rt.keep_free(rt.budget // 16) is True
    assert made == ["resident", "swap"]     # (resident does not fit the smaller budget)
    assert rt.stats()["reschedules"] == before["reschedules"] + 1
    kept, sequence, before, made[:] = rt._schedule, rt._sequence, rt.stats(), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rt.keep_free(rt.budget - 1) is False
    assert made == ["resident", "swap"]
    assert rt._schedule is kept and rt._sequence is sequence
    assert rt.schedule_margin == rt.budget // 16 and rt.stats() == before


def test_keep_free_that_no_plan_fits_leaves_the_recompute_plan(mlp_reference):
    """keep_free plans with recompute too: a margin no plan fits leaves the standing plan's
    recompute state (the reason it recomputes nothing, its chains) as it was."""
    ref, ref_rt = mlp_reference
    capacity = 2 * ref_rt.stats()["peak_device_bytes"] // (2 * MiB) * (2 * MiB)
    rt = runtime("virtual", capacity, recompute=True)
    with pytest.warns(UserWarning, match="recomputes nothing: no budget pressure"):
        nt.train(rt, **MLP)
    chains = rt._rc_chain
    assert rt.keep_free(rt.budget - 1) is False
    assert rt.stats()["recompute_reason"] == "no budget pressure: nothing is swapped"
    assert rt._rc_chain is chains
