"""Property tests: schedulers over random function sequences, replayed by Schedule.check."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmalloc.offload import (FunctionSequence, InCoreScheduler, LMSScheduler, ScheduleError,
                             VDNNScheduler, WindowScheduler)


@st.composite
def sequences(draw, max_functions=40):
    seq = FunctionSequence(name="random")
    nvar = draw(st.integers(1, 24))
    for k in range(nvar):
        seq.add_variable(draw(st.integers(0, 1000)), persistent=draw(st.integers(0, 4)) == 0)
    nfun = draw(st.integers(1, max_functions))
    ids = st.integers(0, nvar - 1)
    for i in range(nfun):
        ins = draw(st.lists(ids, max_size=4, unique=True))
        outs = draw(st.lists(ids, max_size=3, unique=True))
        name = "conv_backward" if draw(st.integers(0, 9)) == 0 else f"f{i}"
        seq.add_function(ins, outs, name=name)
    return seq


def fits(seq, budget, mode):
    """Whether every function's own variables (plus resident persistent ones) fit."""
    fixed = seq.persistent_bytes() if mode == "resident" else 0
    for f in seq.functions:
        own = sum(seq.nbytes(v) for v in f.uses if mode == "swap" or not seq.variables[v].persistent)
        if fixed + own > budget:
            return False
    return fixed <= budget


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(sequences(), st.integers(1, 12000), st.integers(0, 12000),
       st.sampled_from(["swap", "resident"]), st.booleans())
def test_window_passes_check_or_raises_only_when_a_function_cannot_fit(seq, window, budget, mode,
                                                                        drop):
    sched = WindowScheduler(window, budget, persistent=mode, drop=drop)
    if not fits(seq, budget, mode):
        with pytest.raises(ScheduleError):
            sched.schedule(seq)
        return
    s = sched.schedule(seq)
    peak = s.check(seq, budget)
    assert peak <= budget
    assert s.planned_peak == peak


@SETTINGS
@given(sequences(), st.sampled_from(["swap", "resident"]))
def test_window_with_everything_fitting_moves_no_transient_variable(seq, mode):
    total = seq.total_bytes()
    s = WindowScheduler(max(total, 1), total, persistent=mode).schedule(seq)
    s.check(seq, total)
    moved = set(s.swapped_in()) | set(s.swapped_out())
    assert all(seq.variables[v].persistent for v in moved)
    if mode == "resident":
        assert not moved
    else:
        # each persistent variable whose first use reads it comes in once and goes out once
        assert len(s.swapped_in()) == len(set(s.swapped_in()))
        assert sorted(s.swapped_out()) == sorted(s.end_wait_swap_out)


@SETTINGS
@given(sequences())
def test_in_core_passes_check_at_its_peak(seq):
    s = InCoreScheduler().schedule(seq)
    assert s.check(seq, seq.in_core_peak()) == seq.in_core_peak()
    assert not s.swapped_in() and not s.swapped_out()


@SETTINGS
@given(sequences(), st.integers(1, 6), st.integers(0, 4))
def test_lms_passes_check(seq, threshold, ahead):
    s = LMSScheduler(swapout_threshold=threshold, swapin_ahead=ahead).schedule(seq)
    s.check(seq)
    assert all(not seq.variables[v].persistent for v in s.swapped_out())


@SETTINGS
@given(sequences())
def test_vdnn_passes_check(seq):
    s = VDNNScheduler().schedule(seq)
    s.check(seq)
    assert all(not seq.variables[v].persistent for v in s.swapped_out())


@FEWER
@given(sequences(), st.integers(1, 12000), st.integers(0, 12000),
       st.sampled_from(["swap", "resident"]))
def test_window_drop_moves_no_more_and_stays_in_budget(seq, window, budget, mode):
    """Dropping a variable whose host copy is valid replaces a recopy: the same swap-ins, no
    more bytes out, the same budget; and with drops on, no swap-out copies what the host
    already holds (Schedule.check's recopy rule)."""
    if not fits(seq, budget, mode):
        return
    plain = WindowScheduler(window, budget, persistent=mode).schedule(seq)
    dropping = WindowScheduler(window, budget, persistent=mode, drop=True).schedule(seq)
    assert dropping.check(seq, budget) <= budget
    assert dropping.swapped_in() == plain.swapped_in()
    assert dropping.swap_out_bytes(seq) <= plain.swap_out_bytes(seq)
    assert (dropping.swap_out_bytes(seq) + sum(seq.nbytes(v) for v in dropping.dropped())
            == plain.swap_out_bytes(seq))


@FEWER
@given(sequences(), st.integers(1, 6), st.integers(0, 4))
def test_lms_drop_passes_check_and_moves_no_more(seq, threshold, ahead):
    plain = LMSScheduler(swapout_threshold=threshold, swapin_ahead=ahead).schedule(seq)
    dropping = LMSScheduler(swapout_threshold=threshold, swapin_ahead=ahead,
                            drop=True).schedule(seq)
    dropping.check(seq)
    assert dropping.swapped_in() == plain.swapped_in()
    assert dropping.swap_out_bytes(seq) <= plain.swap_out_bytes(seq)
