"""LMS and vDNN on the two-layer example, with the lists derived by hand from their rules."""

import pytest

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload import LMSScheduler, VDNNScheduler


def _example_module():
    # the worked example lives beside this file (tests are not a package)
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "test_window_example.py")
    spec = importlib.util.spec_from_file_location("_window_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


example = _example_module().example
named = _example_module().named


def test_lms_two_layer():
    seq = example()
    sched = LMSScheduler(swapout_threshold=2, swapin_ahead=1).schedule(seq)
    steps, end = named(seq, sched)
    # gaps >= 2 read at b: x 0->4, h1 1->3, gw2 3->5, gw1 4->6; swap-in at max(a+1, b-1),
    # its swap-out waited right before it
    assert steps == [
        {"allocate": ["x", "h1"], "swap_out": ["x"]},
        {"allocate": ["h2"], "swap_out": ["h1"]},
        {"wait_swap_out": ["h1"], "allocate": ["l"], "swap_in": ["h1"], "free": ["h2"]},
        {"wait_swap_out": ["x"], "allocate": ["g1", "gw2"], "swap_in": ["x"],
         "wait_swap_in": ["h1"], "free": ["h1", "l"], "swap_out": ["gw2"]},
        {"wait_swap_out": ["gw2"], "allocate": ["gw1"], "swap_in": ["gw2"],
         "wait_swap_in": ["x"], "free": ["x", "g1"], "swap_out": ["gw1"]},
        {"wait_swap_out": ["gw1"], "swap_in": ["gw1"], "wait_swap_in": ["gw2"],
         "free": ["gw2"]},
        {"wait_swap_in": ["gw1"], "free": ["gw1"]},
    ]
    assert end == []
    assert sched.initial_resident == {1, 2}
    assert sched.params == {"swapout_threshold": 2, "swapin_ahead": 1, "drop": False}
    assert sched.check(seq) == 460


def test_lms_threshold_and_ahead():
    seq = example()
    sched = LMSScheduler(swapout_threshold=4, swapin_ahead=3).schedule(seq)
    steps, _ = named(seq, sched)
    # only x (0 -> 4) has a gap of 4; swap-in at max(1, 4 - 3) = 1
    assert sched.swapped_out() == [0] and sched.swapped_in() == [0]
    assert steps[0]["swap_out"] == ["x"]
    assert steps[1]["wait_swap_out"] == ["x"] and steps[1]["swap_in"] == ["x"]
    assert steps[4]["wait_swap_in"] == ["x"]
    sched.check(seq)
    with pytest.raises(InvalidArgumentError):
        LMSScheduler(swapout_threshold=0)
    with pytest.raises(InvalidArgumentError):
        LMSScheduler(swapin_ahead=-1)


def test_vdnn_two_layer():
    seq = example()
    sched = VDNNScheduler().schedule(seq)
    steps, end = named(seq, sched)
    # forward = fc1, fc2, loss (fc2_backward is the first backward name); x (0 -> 4) and
    # h1 (1 -> 3) are offloaded; l's first backward use is the very next function
    assert sched.params == {"forward_end": 3}
    assert steps == [
        {"allocate": ["x", "h1"], "swap_out": ["x"]},
        {"wait_swap_out": ["x"], "allocate": ["h2"], "swap_out": ["h1"]},
        {"wait_swap_out": ["h1"], "allocate": ["l"], "swap_in": ["h1"], "free": ["h2"]},
        {"allocate": ["g1", "gw2"], "swap_in": ["x"], "wait_swap_in": ["h1"],
         "free": ["h1", "l"]},
        {"allocate": ["gw1"], "wait_swap_in": ["x"], "free": ["x", "g1"]},
        {"free": ["gw2"]},
        {"free": ["gw1"]},
    ]
    assert end == []
    assert sched.check(seq) == 460


def test_vdnn_forward_end_rule():
    seq = example()
    # an explicit forward_end of 2: h2 is then forward-born and read at loss (b = a + 1: kept)
    sched = VDNNScheduler(forward_end=2).schedule(seq)
    assert sched.params == {"forward_end": 2}
    assert [seq.variables[v].name for v in sched.swapped_out()] == ["x", "h1"]
    sched.check(seq)
    # with no backward names the forward pass is the first half
    from vmalloc.offload import FunctionSequence
    s2 = FunctionSequence()
    a, b = s2.add_variable(8), s2.add_variable(8)
    for _ in range(3):
        s2.add_function([a], [b])
    s2.add_function([a, b], [])
    assert VDNNScheduler().schedule(s2).params == {"forward_end": 2}
    with pytest.raises(InvalidArgumentError):
        VDNNScheduler(forward_end=-1)
