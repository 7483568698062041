"""The window scheduler on a worked example in the style of the paper's Figure 2 (a two-layer
network's forward, backward and update), with every decision checked by hand; see
docs/schedulers.rst for the step-by-step walk-through."""

import pytest

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload import (SCHEDULERS, FunctionSequence, InCoreScheduler, LMSScheduler,
                             ScheduleError, VDNNScheduler, WindowScheduler, make_scheduler)

VARIABLES = [("x", 100, False), ("w1", 50, True), ("w2", 50, True), ("h1", 100, False),
             ("h2", 100, False), ("l", 10, False), ("g1", 100, False), ("gw2", 50, False),
             ("gw1", 50, False)]
FUNCTIONS = [("fc1", ["x", "w1"], ["h1"]),
             ("fc2", ["h1", "w2"], ["h2"]),
             ("loss", ["h2"], ["l"]),
             ("fc2_backward", ["l", "h1", "w2"], ["g1", "gw2"]),
             ("fc1_backward", ["g1", "x", "w1"], ["gw1"]),
             ("update2", ["gw2", "w2"], ["w2"]),
             ("update1", ["gw1", "w1"], ["w1"])]


def example():
    seq = FunctionSequence(name="two-layer")
    ids = {name: seq.add_variable(n, persistent=p, name=name) for name, n, p in VARIABLES}
    for name, ins, outs in FUNCTIONS:
        seq.add_function([ids[v] for v in ins], [ids[v] for v in outs], name=name)
    return seq


def named(seq, sched):
    """Each step as {action: [names]} without empty actions, plus the end waits."""
    out = []
    for step in sched.steps:
        d = {}
        for a in ("wait_swap_out", "allocate", "swap_in", "wait_swap_in", "free", "swap_out"):
            if getattr(step, a):
                d[a] = [seq.variables[v].name for v in getattr(step, a)]
        out.append(d)
    return out, [seq.variables[v].name for v in sched.end_wait_swap_out]


def test_worked_example_every_step():
    seq = example()
    trace = []
    sched = WindowScheduler(400, 310).schedule(seq, trace=trace)
    steps, end = named(seq, sched)
    assert steps == [
        # (a) w1 swapped in for fc1; x (input batch) and h1 (fresh) reserved; fc2 does not fit
        # (b): the window stalls at fc2. (c) x, w1, h1 swapped out (h1's is cancelled later).
        {"allocate": ["x", "h1"], "swap_in": ["w1"], "wait_swap_in": ["w1"],
         "swap_out": ["x", "w1"]},
        # (b) admitting fc2 waits for the oldest swap-out (x); h1's swap-out is cancelled.
        {"wait_swap_out": ["x"], "allocate": ["h2"], "swap_in": ["w2"], "wait_swap_in": ["w2"]},
        # (d) h2 never used again: freed; l's swap-out after loss is cancelled at step 3.
        {"allocate": ["l"], "free": ["h2"]},
        {"wait_swap_out": ["w1"], "allocate": ["g1", "gw2"], "free": ["l", "h1"],
         "swap_out": ["w2", "gw2"]},
        {"wait_swap_out": ["w2", "gw2"], "allocate": ["gw1"], "swap_in": ["x", "w1"],
         "wait_swap_in": ["x", "w1"], "free": ["g1", "x"]},
        {"swap_in": ["gw2", "w2"], "wait_swap_in": ["gw2", "w2"], "free": ["gw2"],
         "swap_out": ["w2"]},
        {"free": ["gw1"], "swap_out": ["w1"]},
    ]
    assert end == ["w2", "w1"]
    assert sched.initial_resident == frozenset()
    assert sched.params == {"window": 400, "persistent": "swap", "drop": False}
    assert sched.check(seq, 310) == 310
    name = lambda v: seq.variables[v].name  # noqa: E731
    events = [(e[0], e[1], name(e[2]), *e[3:]) if e[0] in ("wait", "cancel") else e
              for e in trace if e[0] != "admit"]
    assert events == [
        ("window", 0, 2), ("stall", 0, 1),
        ("window", 1, 3), ("wait", 1, "x"), ("cancel", 1, "h1", 0),
        ("window", 2, 3),
        ("window", 3, 4), ("wait", 3, "w1"), ("cancel", 3, "l", 2), ("cancel", 3, "h1", 1),
        ("cancel", 3, "w2", 1),
        ("window", 4, 7), ("wait", 4, "w2"), ("wait", 4, "gw2"), ("cancel", 4, "g1", 3),
        ("stall", 4, 5),
        ("window", 5, 7), ("cancel", 5, "gw1", 4), ("cancel", 5, "w1", 4),
        ("window", 6, 7)]


def test_worked_example_persistent_resident():
    seq = example()
    sched = WindowScheduler("1KiB", 1000, persistent="resident").schedule(seq)
    steps, end = named(seq, sched)
    assert sched.initial_resident == {1, 2}
    assert end == []
    assert not sched.swapped_in() and not sched.swapped_out()
    assert sched.check(seq, 1000) == seq.in_core_peak()


def test_function_that_cannot_fit_names_itself():
    seq = example()
    with pytest.raises(ScheduleError) as e:
        WindowScheduler(400, 299).schedule(seq)
    # fc2_backward uses l, h1, w2, g1, gw2: 310 bytes
    assert e.value.function == 3
    assert "function 3 (fc2_backward) needs 310 B (310 bytes); the budget is 299 B" in str(e.value)
    with pytest.raises(ScheduleError) as e:
        WindowScheduler(400, 350, persistent="resident").schedule(seq)
    assert e.value.function == 3
    assert "100 B of it resident persistent" in str(e.value)


def test_sizes_as_strings_and_bad_arguments():
    s = WindowScheduler("4GiB", "12GiB")
    assert (s.window, s.budget) == (4 << 30, 12 << 30)
    with pytest.raises(InvalidArgumentError):
        WindowScheduler(0, 10)
    with pytest.raises(InvalidArgumentError):
        WindowScheduler(10, 10, persistent="pinned")


def test_make_scheduler():
    assert SCHEDULERS == ("window", "lms", "vdnn", "none")
    assert isinstance(make_scheduler("window", window="1MiB", budget="2MiB"), WindowScheduler)
    assert isinstance(make_scheduler("lms", swapout_threshold=3), LMSScheduler)
    assert isinstance(make_scheduler("vdnn"), VDNNScheduler)
    assert isinstance(make_scheduler("none"), InCoreScheduler)
    with pytest.raises(InvalidArgumentError):
        make_scheduler("magic")
    with pytest.raises(InvalidArgumentError):
        make_scheduler("none", budget=3)
