"""The window scheduler's compiled main loop (vmalloc/offload/scheduling/_window_loop.pyx, issue
22 item 6) makes exactly the decisions of the Python loop it replaced, which stays as the reference
(``WindowScheduler._schedule_py``, also the one that records ``trace=``)."""

import importlib.util
import pathlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmalloc.offload import FunctionSequence, ScheduleError, WindowScheduler


def _pinned():
    """test_schedule_pinned's sequences (the test modules are not importable by name here)."""
    path = pathlib.Path(__file__).with_name("test_schedule_pinned.py")
    spec = importlib.util.spec_from_file_location("_schedule_pinned", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PINNED = _pinned()
chain_sequence, random_sequence = _PINNED.chain_sequence, _PINNED.random_sequence


def _text(s):
    return repr(([(st.drop, st.wait_swap_out, st.allocate, st.swap_in, st.wait_swap_in, st.free,
                   st.swap_out) for st in s.steps], sorted(s.initial_resident),
                 s.end_wait_swap_out, s.end_drop, s.scheduler, s.budget, s.params))


def _outcome(fn, seq):
    try:
        return _text(fn(seq))
    except ScheduleError as e:
        return ("error", str(e), e.function, e.needed_bytes)


def _both(sched, seq):
    """(compiled, Python) outcomes: the schedule's full text, or the error said."""
    compiled = _outcome(sched.schedule, seq)
    reference = _outcome(lambda s: sched._schedule_py(s, None), seq)
    return compiled, reference


@st.composite
def sequences(draw):
    """Random reads and writes, a variable mentioned twice by one function included."""
    seq = FunctionSequence(name="random")
    nvar = draw(st.integers(1, 20))
    for _ in range(nvar):
        seq.add_variable(draw(st.integers(0, 1000)), persistent=draw(st.integers(0, 3)) == 0)
    ids = st.integers(0, nvar - 1)
    for i in range(draw(st.integers(0, 40))):
        seq.add_function(draw(st.lists(ids, max_size=4)), draw(st.lists(ids, max_size=3)),
                         name=f"f{i}")
    return seq


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences(), st.integers(1, 8000), st.one_of(st.integers(0, 8000), st.just(1 << 56)),
       st.sampled_from(["swap", "resident"]), st.booleans())
def test_compiled_loop_decides_as_the_python_loop(seq, window, budget, mode, drop):
    compiled, reference = _both(WindowScheduler(window, budget, mode, drop), seq)
    assert compiled == reference


@pytest.mark.parametrize("seed", range(12))
def test_compiled_loop_on_the_pinned_sequences(seed):
    """The sequences and parameter grid of test_schedule_pinned, tight budgets (waits, stalls,
    cancels, drops taken and kept) included."""
    seqs = [random_sequence(seed)] + ([chain_sequence()] if seed == 0 else [])
    for seq in seqs:
        peak = max(seq.in_core_peak(), 1)
        for wf, bf in ((1 / 8, 1 / 4), (1 / 2, 1 / 2), (1 / 16, 0.9), (2, 1.0), (1 / 64, 0.3),
                       (1 / 32, 0.15)):
            for mode in ("swap", "resident"):
                for drop in (False, True):
                    sched = WindowScheduler(max(1, int(wf * peak)), int(bf * peak), mode, drop)
                    compiled, reference = _both(sched, seq)
                    assert compiled == reference


def test_the_compiled_loop_is_the_one_taken(monkeypatch):
    """Without ``trace`` the Python loop is not run at all; with it, it is (it records)."""
    seq = chain_sequence()
    peak = seq.in_core_peak()
    sched = WindowScheduler(peak // 8, peak // 3, drop=True)
    expected = _text(sched._schedule_py(seq, None))
    calls = []
    real = WindowScheduler._schedule_py
    monkeypatch.setattr(WindowScheduler, "_schedule_py",
                        lambda self, s, trace: calls.append(trace) or real(self, s, trace))
    assert _text(sched.schedule(seq)) == expected
    assert calls == []
    trace = []
    assert _text(sched.schedule(seq, trace=trace)) == expected
    assert calls == [trace] and ("window", 0, trace[0][2]) == trace[0]


def test_byte_totals_past_int64_take_the_python_loop():
    """Sizes summing to 2**62 or more (64 variables at vmalloc's 2**56 limit) would overflow the
    compiled loop's int64 sums: the Python loop schedules them, with Python integers."""
    seq = FunctionSequence(name="huge")
    big = [seq.add_variable(1 << 56, name=f"a{k}") for k in range(64)]
    c = seq.add_variable(0, name="c")
    for k, v in enumerate(big):
        seq.add_function([], [v], name=f"make{k}")
    seq.add_function(big[:2], [c], name="use")
    sched = WindowScheduler(1 << 56, 1 << 56)
    assert sched._schedule_compiled(seq) is None
    with pytest.raises(ScheduleError, match=r"function 64 \(use\) needs 128.00 PiB "
                                            r"\(144115188075855872 bytes\)") as e:
        sched.schedule(seq)
    assert e.value.function == 64 and e.value.needed_bytes == 1 << 57
    seq.functions.pop()
    seq.add_function(big[:1], [c], name="use")
    s = sched.schedule(seq)
    assert _text(s) == _text(sched._schedule_py(seq, None))
    assert s.check(seq, 1 << 56) == 1 << 56


def test_an_unfit_function_is_said_as_before():
    rng = random.Random(3)
    seq = FunctionSequence(name="unfit")
    vs = [seq.add_variable(rng.randint(100, 200), persistent=k < 2) for k in range(6)]
    seq.add_function([vs[0]], [vs[2]], name="first")
    seq.add_function([vs[2], vs[1], vs[3]], [vs[4], vs[5]], name="wide")
    for mode in ("swap", "resident"):
        sched = WindowScheduler(10_000, sum(seq.nbytes(v) for v in vs[2:]) - 1, mode)
        compiled, reference = _both(sched, seq)
        assert compiled == reference and compiled[0] == "error" and compiled[2] == 1
