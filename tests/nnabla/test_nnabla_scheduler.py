"""vmalloc.nnabla against unscheduled training and nnabla's own SwapInOutScheduler (Python
3.10 with nnabla; skipped elsewhere, e.g. by the main Python 3.11 run)."""

import os
import subprocess
import sys

import pytest

nn = pytest.importorskip("nnabla", reason="nnabla is not installed (its wheels exist for "
                         "Python 3.8-3.10; scripts/nnabla-env makes such an environment)")
pytest.importorskip("nnabla.lms")

sys.path.insert(0, os.path.dirname(__file__))
import _nets  # noqa: E402

from vmalloc.nnabla import WindowSwapScheduler  # noqa: E402
from vmalloc.offload import BudgetWarning  # noqa: E402

BUDGET = 800_000        # bytes; the network's in-core peak is ~1.2 MB, its largest function ~0.6 MB
ITERATIONS = 6


def ours(budget=BUDGET, **kw):
    return lambda host, device, solver: WindowSwapScheduler(host, device, budget,
                                                            solver=solver, **kw)


@pytest.fixture(scope="module")
def baseline():
    losses, _ = _nets.train(ITERATIONS)
    return losses


def test_identical_losses_and_bytes(baseline):
    losses, sched = _nets.train(ITERATIONS, ours())
    assert losses == baseline
    st = sched.stats()
    assert st["recorded_iterations"] == 1 and st["scheduled_iterations"] == ITERATIONS - 1
    assert st["diverged_iterations"] == 0 and st["schedule_failures"] == 0
    assert st["planned_peak_bytes"] <= BUDGET < st["in_core_peak_bytes"]
    runs = [h for h in sched.history if h["mode"] == "run"]
    # every scheduled iteration after the first (which also moves what the record left on the
    # device to where the schedule starts) moves the same bytes, and the schedule brought in
    # everything a function read: after the record the one on-demand swap-in per iteration is
    # the loss, a persistent array Mean only writes (the schedule plans no swap-in for it)
    assert len({(h["swap_in_bytes"], h["swap_out_bytes"]) for h in runs[1:]}) == 1
    assert runs[0]["swap_in_bytes"] > 0 and runs[0]["swap_out_bytes"] > 0
    assert [h["on_demand_swap_ins"] for h in runs] == [1] * len(runs)
    sched.schedule.check(sched.sequence, BUDGET)


def test_nnabla_scheduler_identical_losses(baseline):
    losses, _ = _nets.train(ITERATIONS, _nets.nnabla_scheduler(BUDGET))
    assert losses == baseline


@pytest.mark.parametrize("scheduler", ["window", "lms", "vdnn"])
def test_other_schedulers(baseline, scheduler):
    losses, sched = _nets.train(4, ours(scheduler=scheduler))
    assert losses == baseline[:4]
    assert sched.stats()["scheduled_iterations"] == 3


def test_persistent_resident(baseline):
    losses, sched = _nets.train(4, ours(budget=2_000_000, persistent="resident"))
    assert losses == baseline[:4]


def test_budget_too_small_runs_on_demand(baseline):
    with pytest.warns(BudgetWarning, match=r"needs \d+ bytes"):
        losses, sched = _nets.train(3, ours(budget=100_000))
    assert losses == baseline[:3]
    assert [h["mode"] for h in sched.history] == ["record", "on_demand", "on_demand"]
    assert sched.schedule is None and "needs" in sched.stats()["schedule_error"]


@pytest.mark.parametrize("kinds, why", [
    ({2: "tail"}, "runs past the end of the record"),
    ({0: "tail"}, "the iteration ended after"),
    ({2: "reordered"}, "function 4 (Convolution"),
    ({2: "longer"}, "function 11 (AddScalar) differs"),
])
def test_changed_iterations_survive(baseline, kinds, why):
    losses, sched = _nets.train(ITERATIONS, ours(), kinds)
    assert losses == baseline
    modes = [h["mode"] for h in sched.history]
    bad = [h for h in sched.history if h["mismatch"]]
    assert len(bad) == 1 and why in bad[0]["mismatch"]
    k = modes.index("on_demand")
    # the next iteration is recorded and scheduled anew; the ones after run the new schedule
    assert modes[k + 1] == "record" and set(modes[k + 2:]) <= {"run"}
    assert sched.stats()["reschedules"] == 1


def _run_nnabla(kind, at):
    return subprocess.run([sys.executable, _nets.__file__, str(BUDGET), kind, str(at)],
                          capture_output=True, text=True, timeout=120)


def test_nnabla_scheduler_segfaults_on_longer_iteration(baseline):
    p = _run_nnabla("tail", 2)
    assert p.returncode in (-11, 139), (p.returncode, p.stdout, p.stderr[-2000:])
    losses, sched = _nets.train(5, ours(), {2: "tail"})
    assert losses == baseline[:5]


def test_nnabla_scheduler_shorter_iteration_works(baseline):
    p = _run_nnabla("tail", 0)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"losses {baseline[:5]}" in p.stdout


def test_hooks_removed_and_api():
    host, device = _nets.contexts()
    nn.set_default_context(device)
    x, t, mid, loss, solver, feed = _nets.build()
    sched = WindowSwapScheduler(host, device, "1MiB", solver=solver)
    sched.start()
    _nets.step(loss, solver, feed, 0)
    sched.end()
    with pytest.raises(RuntimeError):
        sched.end()
    # no hook left behind: a step outside the scheduler leaves its statistics alone
    before = sched.stats()
    _nets.step(loss, solver, feed, 1)
    assert sched.stats() == before
    assert sched.window is None and sched.budget == 1 << 20     # the window: the budget


def test_out_of_core_has_the_shape_of_every_driver(baseline):
    """vmalloc.nnabla.out_of_core: a context manager with step() per iteration and stats()
    with the common keys, kept after the block; the shared defaults."""
    import vmalloc.frameworks.nnabla as driver
    import vmalloc.nnabla
    from vmalloc.offload.runtime import STATS_KEYS

    assert vmalloc.nnabla is driver
    host, device = _nets.contexts()
    nn.set_default_context(device)
    x, t, mid, loss, solver, feed = _nets.build()
    losses = []
    with vmalloc.nnabla.out_of_core(budget=BUDGET, host_ctx=host, device_ctx=device) as ooc:
        assert (ooc.persistent, ooc.window) == ("auto", None)
        for i in range(3):
            with ooc.step():
                losses.append(_nets.step(loss, solver, feed, i))
    assert losses == baseline[:3]
    st = ooc.stats()
    assert set(STATS_KEYS) <= set(st)
    assert st["budget_bytes"] == BUDGET and st["scheduled_iterations"] == 2
    assert st["device_bytes"] == ooc.runtime.stats()["device_bytes"]
    with pytest.raises(NotImplementedError, match="cannot take an external allocator"):
        vmalloc.nnabla.use_vmalloc()


def test_a_scheduler_is_freed_as_soon_as_it_is_dropped():
    """Before: the runtime's at_boundary was the driver's bound method, so driver and runtime
    held each other until a full collection (with every array they track). With the
    collector off, dropping the scheduler now frees both at once."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        losses, sched = _nets.train(3, ours())
        refs = [weakref.ref(sched), weakref.ref(sched.runtime)]
        del sched
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()
