"""Schedule.check: one test per rule, each naming the function where it breaks."""

import pytest

from vmalloc.offload import FunctionSequence, InCoreScheduler, Schedule, ScheduleError, Step


def seq3():
    """p (persistent, 10 B); f0 reads p, writes a; f1 reads a, writes b; f2 reads b and p."""
    seq = FunctionSequence()
    p = seq.add_variable(10, persistent=True, name="p")
    a = seq.add_variable(20, name="a")
    b = seq.add_variable(40, name="b")
    seq.add_function([p], [a], name="f0")
    seq.add_function([a], [b], name="f1")
    seq.add_function([b, p], [], name="f2")
    return seq, p, a, b


def sched(steps, resident=(0,), end=()):
    return Schedule("test", [Step(**s) for s in steps], initial_resident=frozenset(resident),
                    end_wait_swap_out=list(end))


def in_core(seq):
    return InCoreScheduler().schedule(seq)


def fails(seq, s, function, text, budget=None):
    with pytest.raises(ScheduleError) as e:
        s.check(seq, budget)
    assert e.value.function == function, str(e.value)
    assert text in str(e.value)


def test_in_core_passes_and_sets_planned_peak():
    seq, p, a, b = seq3()
    s = in_core(seq)
    assert s.check(seq, 70) == 70 == seq.in_core_peak()
    assert s.planned_peak == 70


def test_budget():
    seq, *_ = seq3()
    fails(seq, in_core(seq), 1, "device bytes reach 70 after allocate and swap_in; the budget "
          "is 69", budget=69)


def test_read_not_resident():
    seq, p, a, b = seq3()
    fails(seq, sched([{"allocate": [a], "free": [a]}, {"allocate": [b]}, {"free": [b]}]),
          1, "reads a (v1), which is absent, not resident")


def test_read_swap_in_not_waited():
    seq, p, a, b = seq3()
    s = sched([{"allocate": [a], "swap_out": [p]}, {"allocate": [b], "free": [a]},
               {"wait_swap_out": [p], "swap_in": [p], "free": [b]}])
    fails(seq, s, 2, "reads p (v0), whose swap-in was not waited")


def test_read_allocated_without_content():
    seq, p, a, b = seq3()
    s = sched([{"allocate": [a], "swap_out": [p]}, {"wait_swap_out": [p], "allocate": [b],
                                                     "free": [a]},
               {"allocate": [p], "free": [b]}])
    fails(seq, s, 2, "reads p (v0), which was allocated but never written")


def test_write_without_memory():
    seq, p, a, b = seq3()
    fails(seq, sched([{}, {}, {}]), 0, "writes a (v1), which has no memory (absent)")


def test_read_while_transfers_are_in_flight():
    seq = FunctionSequence()
    p = seq.add_variable(10, persistent=True, name="p")
    seq.add_function([p], [p])
    seq.add_function([p], [p])
    s = sched([{"swap_out": [p]}, {"wait_swap_out": [p], "swap_in": [p]}])
    fails(seq, s, 1, "reads p (v0), whose swap-in was not waited")
    s = sched([{"swap_in": [p], "wait_swap_in": [p]}, {}], resident=())
    s.steps[0].swap_out = [p]
    s.steps[1].wait_swap_out = [p]
    fails(seq, s, 1, "reads p (v0), which is on_host, not resident")


def test_swap_in_not_on_host():
    seq, p, a, b = seq3()
    fails(seq, sched([{"swap_in": [a]}, {}, {}]), 0, "swap_in of a (v1), which is absent")


def test_swap_out_not_resident():
    seq, p, a, b = seq3()
    s = sched([{"allocate": [a]}, {"allocate": [b], "free": [a], "swap_out": [a]}, {}])
    fails(seq, s, 1, "swap_out of a (v1), which is absent, not resident")


def test_wait_not_in_flight():
    seq, p, a, b = seq3()
    fails(seq, sched([{"wait_swap_in": [p]}, {}, {}]), 0, "wait_swap_in of p (v0), which is "
          "resident, not swapping in")
    fails(seq, sched([{"wait_swap_out": [p]}, {}, {}]), 0, "wait_swap_out of p (v0), which is "
          "resident, not swapping out")


def test_allocate_holding_memory():
    seq, p, a, b = seq3()
    fails(seq, sched([{"allocate": [p, a]}, {}, {}]), 0, "allocate of p (v0), which already "
          "holds memory (resident)")


def test_free_not_resident():
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.steps[1].free.append(b)
    s.steps[1].free.append(b)
    fails(seq, s, 1, "free of b (v2), which is absent, not resident")


def test_transient_alive_at_end():
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.steps[2].free.remove(b)
    fails(seq, s, None, "transient b (v2) is still alive (resident)")


def test_persistent_moved():
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.steps[2].swap_out.append(p)
    s.end_wait_swap_out.append(p)
    fails(seq, s, None, "persistent p (v0) ends on_host; it started resident")


def test_swap_out_in_flight_at_end():
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.steps[2].swap_out.append(p)
    fails(seq, s, None, "the swap-out of p (v0) is still in flight")


def test_redundant_swap_in():
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.initial_resident = frozenset()
    s.steps[0].swap_in.append(p)
    s.steps[0].wait_swap_in.append(p)
    s.steps[1].swap_out.append(p)              # swapped in at f0, read there: fine so far
    s.steps[2].wait_swap_out.append(p)
    s.steps[2].swap_in.append(p)
    s.steps[2].wait_swap_in.append(p)
    s.steps[2].swap_out.append(p)
    s.end_wait_swap_out.append(p)
    # p is only read: its swap-outs copy what the host already holds (a recopy)
    fails(seq, s, 1, "recopy: p (v0) is swapped out although its host copy is still valid")
    s.params["drop"] = False        # a scheduler asked not to drop may recopy
    assert s.check(seq) == 70
    # a swap-in no function reads before the swap-out
    s.steps[1].wait_swap_out.append(p)
    s.steps[1].swap_in.append(p)
    s.steps[1].wait_swap_in.append(p)
    s.steps[0].swap_out.append(p)
    s.steps[1].swap_out.append(p)
    fails(seq, s, 1, "redundant swap-in: p (v0) is swapped out without being read")


def test_redundant_swap_in_overwritten():
    seq = FunctionSequence()
    p = seq.add_variable(10, persistent=True, name="p")
    seq.add_function([], [p], name="init")
    fails(seq, sched([{"swap_in": [p], "wait_swap_in": [p]}], resident=()), 0,
          "redundant swap-in: p (v0) was swapped in but this function overwrites it")


def test_redundant_swap_in_freed():
    seq = FunctionSequence()
    a = seq.add_variable(8, name="a")
    seq.add_function([], [a], name="make")
    seq.add_function([], [], name="other")
    seq.add_function([a], [], name="use")
    s = sched([{"allocate": [a], "swap_out": [a]},
               {"wait_swap_out": [a], "swap_in": [a], "wait_swap_in": [a], "free": [a]},
               {}], resident=())
    fails(seq, s, 1, "redundant swap-in: a (v0) is freed without being read since its swap-in")


def test_redundant_swap_out_never_used_again():
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.steps[2].free.remove(b)
    s.steps[2].swap_out.append(b)
    s.end_wait_swap_out.append(b)
    fails(seq, s, 2, "redundant swap-out: b (v2) is never used again (free it instead)")


def test_redundant_swap_out_next_use_write_only():
    seq = FunctionSequence()
    a = seq.add_variable(8, name="a")
    seq.add_function([], [a], name="w1")
    seq.add_function([], [a], name="w2")
    seq.add_function([a], [], name="r")
    s = sched([{"allocate": [a], "swap_out": [a]}, {"wait_swap_out": [a], "allocate": [a]},
               {"free": [a]}], resident=())
    fails(seq, s, 0, "redundant swap-out: the next use of a (v0) (function 1) overwrites it")
    # freeing it instead is right
    s = sched([{"allocate": [a], "free": [a]}, {"allocate": [a]}, {"free": [a]}], resident=())
    assert s.check(seq) == 8


def test_redundant_swap_out_persistent_wraps():
    seq = FunctionSequence()
    p = seq.add_variable(8, persistent=True, name="p")
    seq.add_function([], [p], name="zero")
    seq.add_function([p], [], name="use")
    # the next iteration overwrites p first: swapping it out is redundant; freeing it is right
    s = sched([{"allocate": [p]}, {"swap_out": [p]}], resident=(), end=[p])
    fails(seq, s, 1, "redundant swap-out: the next use of p (v0) (function 0) overwrites it")
    s = sched([{"allocate": [p]}, {"free": [p]}], resident=())
    assert s.check(seq) == 8


def test_wrong_length_and_bad_ids():
    seq, p, a, b = seq3()
    with pytest.raises(ScheduleError):
        sched([{}]).check(seq)
    fails(seq, sched([{"allocate": [99]}, {}, {}]), 0, "allocate: 99 is not a variable id")


def test_drop_needs_a_valid_host_copy():
    """No waste: a read-only variable goes back to the host by a drop (no copy); a variable
    written since its last copy cannot be dropped, and nothing reads a dropped variable."""
    seq, p, a, b = seq3()
    s = in_core(seq)
    s.initial_resident = frozenset()
    s.steps[0].swap_in.append(p)
    s.steps[0].wait_swap_in.append(p)
    s.steps[1].drop.append(p)                   # read at f0: the host copy is still valid
    s.steps[2].swap_in.append(p)
    s.steps[2].wait_swap_in.append(p)
    s.end_drop.append(p)
    assert s.check(seq) == 60       # p's 10 bytes are gone while f1 holds a and b
    assert s.dropped() == [p, p] and s.swap_out_bytes(seq) == 0
    # nothing reads a dropped variable
    bad = in_core(seq)
    bad.initial_resident = frozenset()
    bad.steps[0].swap_in.append(p)
    bad.steps[0].wait_swap_in.append(p)
    bad.steps[1].drop.append(p)
    bad.end_drop.append(p)
    fails(seq, bad, 2, "reads p (v0), which is on_host, not resident")
    # a written variable has no valid host copy: it must be swapped out
    seq2 = FunctionSequence()
    x = seq2.add_variable(10, name="x")
    seq2.add_function(outputs=[x], name="w")
    seq2.add_function(inputs=[x], name="r1")
    seq2.add_function(inputs=[x], name="r2")
    s2 = in_core(seq2)
    s2.steps[1].drop.append(x)
    fails(seq2, s2, 1, "drop of x (v0), whose host copy is not valid")
