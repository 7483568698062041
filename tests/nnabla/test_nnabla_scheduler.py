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
    assert st["mismatches"] == 0 and st["schedule_failures"] == 0
    assert st["planned_peak_bytes"] <= BUDGET < st["in_core_peak_bytes"]
    runs = [h for h in sched.history if h["mode"] == "run"]
    # every scheduled iteration moves the same bytes, and the schedule brought in everything a
    # function read: no on-demand swap-in after the record
    assert len({(h["swap_in_bytes"], h["swap_out_bytes"]) for h in runs}) == 1
    assert runs[0]["swap_in_bytes"] > 0 and runs[0]["swap_out_bytes"] > 0
    assert st["on_demand_swap_in_bytes"] == sched.history[0]["swap_in_bytes"]
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
    with pytest.warns(RuntimeWarning, match="cannot be scheduled"):
        losses, sched = _nets.train(3, ours(budget=100_000))
    assert losses == baseline[:3]
    assert sched.stats()["on_demand_iterations"] == 2 and sched.schedule is None


@pytest.mark.parametrize("kinds, why", [
    ({2: "tail"}, "longer iteration"),
    ({0: "tail"}, "shorter iteration"),
    ({2: "reordered"}, "function 4 is Convolution"),
    ({2: "longer"}, "function 11 is AddScalar"),
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
    assert sched.window == int(1.5 * (1 << 20))
