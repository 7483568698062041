"""The out-of-core simulator: exact times on hand-built schedules, real allocators for memory."""

import math

import pytest

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.hardware.gpus import GPU, GPUS, get_gpu
from vmalloc.offload.scheduling.schedule import Schedule, Step
from vmalloc.offload.sequence.sequence import FunctionSequence
from vmalloc.offload.simulation.simulator import in_core_seconds, simulate

MiB = 1 << 20
GB = 10**9

# A GPU with round numbers: 10 GB/s each way (also both at once), no overhead.
TOY = GPU(name="toy", memory_bytes=8 << 30, peak_flops=1e12, compute_efficiency=1.0,
          hbm_bandwidth=math.inf, h2d_bandwidth=10 * GB, d2h_bandwidth=10 * GB,
          bidirectional_bandwidth=10 * GB, function_overhead_seconds=0.0)


def three_functions():
    """f0 writes a (1 GB), f1 (0.2 s) runs while a is swapped out, f2 reads a back."""
    seq = FunctionSequence(name="toy3", batch=10)
    a = seq.add_variable(GB)
    b = seq.add_variable(MiB)
    c = seq.add_variable(MiB)
    seq.add_function(inputs=[], outputs=[a], seconds=0.1, name="f0")
    seq.add_function(inputs=[], outputs=[b], seconds=0.2, name="f1")
    seq.add_function(inputs=[a, b], outputs=[c], seconds=0.1, name="f2")
    return seq, a, b, c


def swap_schedule(a, b, c):
    steps = [Step(allocate=[a], swap_out=[a]),
             Step(wait_swap_out=[], allocate=[b], swap_in=[]),
             Step(wait_swap_out=[a], allocate=[c], swap_in=[a], wait_swap_in=[a],
                  free=[a, b, c])]
    return Schedule("hand", steps, budget=2 * GB)


def test_hand_built_schedule_exact_times():
    seq, a, b, c = three_functions()
    r = simulate(seq, swap_schedule(a, b, c), gpu=TOY, timeline=True, va_costs=False)
    assert not r.out_of_memory
    # f0 0..0.1; swap-out 0.1..0.2 overlaps f1 0.1..0.3; host issues f2's step at f1's start
    # (0.1), waits for the swap-out (0.2), swaps in 0.2..0.3; f2 runs 0.3..0.4: no stall.
    assert r.timeline["compute"] == [(0.0, 0.1, 0), (0.1, pytest.approx(0.3), 1),
                                     (pytest.approx(0.3), pytest.approx(0.4), 2)]
    assert r.timeline["d2h"] == [(0.1, pytest.approx(0.2), a)]
    assert r.timeline["h2d"] == [(pytest.approx(0.2), pytest.approx(0.3), a)]
    assert r.iteration_seconds == pytest.approx(0.4)
    assert r.compute_seconds == pytest.approx(0.4)
    assert r.speed_vs_compute_only == pytest.approx(1.0)
    assert r.images_per_second == pytest.approx(10 / 0.4)
    assert r.swapped_out_bytes == GB and r.swapped_in_bytes == GB
    assert r.bound_seconds == pytest.approx(0.4)
    assert sum(r.stall_seconds.values()) == pytest.approx(0.0, abs=1e-12)


def test_swap_in_stall_is_counted():
    seq, a, b, c = three_functions()
    gpu = TOY.with_(h2d_bandwidth=2.5 * GB)   # swap-in 0.4 s: 0.2..0.6, f2 waits 0.3
    r = simulate(seq, swap_schedule(a, b, c), gpu=gpu, va_costs=False)
    assert r.iteration_seconds == pytest.approx(0.7)
    assert r.stall_seconds["swap_in"] == pytest.approx(0.3)
    assert r.stall_seconds["swap_out"] == pytest.approx(0.0, abs=1e-12)
    assert r.bound_seconds == pytest.approx(0.4)     # max(compute, 1 GB / 2.5 GB/s)


def test_swap_out_wait_stalls_the_host():
    seq, a, b, c = three_functions()
    gpu = TOY.with_(d2h_bandwidth=2.5 * GB)   # swap-out 0.1..0.5; host waits until 0.5
    r = simulate(seq, swap_schedule(a, b, c), gpu=gpu, va_costs=False)
    # swap-in 0.5..0.6, f2 0.6..0.7; compute idle 0.3..0.6 (0.2 swap-out, 0.1 swap-in)
    assert r.iteration_seconds == pytest.approx(0.7)
    assert r.stall_seconds["swap_out"] == pytest.approx(0.2)
    assert r.stall_seconds["swap_in"] == pytest.approx(0.1)


def test_both_directions_share_the_link():
    # x's swap-out runs 0.1..0.2 (placed first, alone). y's swap-in is issued at f1's start
    # (0.1): at the both-at-once 5 GB/s while the swap-out runs (0.5 GB by 0.2), then at
    # 10 GB/s alone: done at 0.25.
    seq = FunctionSequence(batch=1)
    x = seq.add_variable(GB)
    y = seq.add_variable(GB, persistent=True)
    seq.add_function(outputs=[x], seconds=0.1)
    seq.add_function(inputs=[x], outputs=[], seconds=0.3)
    seq.add_function(inputs=[y], outputs=[], seconds=0.1)
    steps = [Step(allocate=[x], swap_out=[x]),
             Step(),
             Step(swap_in=[y], wait_swap_in=[y], free=[x], swap_out=[y])]
    sched = Schedule("hand", steps, end_wait_swap_out=[y])
    r = simulate(seq, sched, gpu=TOY.with_(bidirectional_bandwidth=5 * GB), timeline=True,
                 va_costs=False)
    assert r.timeline["d2h"][0] == (0.1, pytest.approx(0.2), x)
    assert r.timeline["h2d"] == [(pytest.approx(0.1), pytest.approx(0.25), y)]
    # f2 runs 0.4..0.5; y's swap-out after it (0.5..0.6) ends the iteration
    assert r.iteration_seconds == pytest.approx(0.6)
    assert r.stall_seconds["tail"] == pytest.approx(0.1)


def test_unlimited_bandwidth_equals_in_core_time():
    seq, a, b, c = three_functions()
    gpu = TOY.with_(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf,
                    bidirectional_bandwidth=math.inf)
    r = simulate(seq, swap_schedule(a, b, c), gpu=gpu, va_costs=False)
    assert r.iteration_seconds == pytest.approx(in_core_seconds(seq, gpu))
    assert r.speed_vs_compute_only == pytest.approx(1.0)


def test_in_core_default_schedule_and_flops_model():
    seq = FunctionSequence(batch=4)
    w = seq.add_variable(100 * MiB, persistent=True)
    x = seq.add_variable(10 * MiB)
    seq.add_function(inputs=[w], outputs=[x], flops=2e12)
    gpu = TOY.with_(compute_efficiency=0.5, hbm_bandwidth=1e9, function_overhead_seconds=1e-3)
    # max(2e12 / 0.5e12, 110 MiB / 1 GB/s) + 1 ms
    expect = max(4.0, 110 * MiB / 1e9) + 1e-3
    r = simulate(seq, gpu=gpu)
    assert r.iteration_seconds == pytest.approx(expect)
    assert r.scheduler == "none"
    assert r.peak_requested_bytes == 110 * MiB


def test_out_of_memory_names_the_function():
    seq, a, b, c = three_functions()
    r = simulate(seq, swap_schedule(a, b, c), gpu=TOY, capacity="512MiB")
    assert r.out_of_memory
    assert r.oom_function == {"index": 0, "name": "f0"}
    assert "out of memory" in r.oom_message
    assert r.iteration_seconds is None and r.images_per_second is None
    assert r.to_dict()["out_of_memory"] is True


def test_deterministic():
    seq, a, b, c = three_functions()
    one = simulate(seq, swap_schedule(a, b, c), gpu=TOY, timeline=True).to_dict(timeline=True)
    two = simulate(seq, swap_schedule(a, b, c), gpu=TOY, timeline=True).to_dict(timeline=True)
    assert one == two


def fragmenting():
    """40 activations of 10 MiB, every other one swapped out (and not needed again), then 20
    of 15 MiB: best-fit caching cannot put a 15 MiB block in a 10 MiB hole, chunks can."""
    seq = FunctionSequence(name="frag", batch=1)
    small = [seq.add_variable(10 * MiB) for _ in range(40)]
    big = [seq.add_variable(15 * MiB) for _ in range(20)]
    for v in small + big:
        seq.add_function(outputs=[v], seconds=1e-3)
    kept = small[1::2]
    seq.add_function(inputs=kept + big, seconds=1e-3)
    steps = [Step(allocate=[v]) for v in small + big]
    steps.append(Step(free=kept + big))
    for k, v in enumerate(small[::2]):
        steps[2 * k].swap_out.append(v)
    steps[len(small)].wait_swap_out = small[::2]     # released once all 40 are allocated
    return seq, Schedule("hand", steps)


def test_caching_reserves_more_than_virtual_on_a_fragmenting_pattern():
    seq, sched = fragmenting()
    caching = simulate(seq, sched, gpu=TOY, allocator="caching")
    virtual = simulate(seq, sched, gpu=TOY, allocator="virtual")
    packed = simulate(seq, sched, gpu=TOY, allocator="virtual-packed")
    assert caching.peak_requested_bytes == virtual.peak_requested_bytes
    assert caching.peak_reserved_bytes > virtual.peak_reserved_bytes
    assert packed.peak_reserved_bytes <= caching.peak_reserved_bytes
    # on a device of 540 MiB caching runs out of memory at the first 15 MiB block that does
    # not fit, the virtual allocator does not
    small = simulate(seq, sched, gpu=TOY, allocator="caching", capacity="540MiB")
    assert small.out_of_memory and small.oom_function["name"].startswith("f")
    assert not simulate(seq, sched, gpu=TOY, allocator="virtual", capacity="540MiB").out_of_memory
    assert caching.peak_reserved_bytes == 720 * MiB     # 40 x 10 + 20 x 16 (2 MiB rounding)
    assert virtual.peak_requested_bytes == 500 * MiB
    assert virtual.peak_reserved_bytes == 520 * MiB   # 15 MiB -> 8 chunks of 2 MiB


def test_chunk_size_is_a_parameter():
    seq, sched = fragmenting()
    r = simulate(seq, sched, gpu=TOY, allocator="virtual", chunk_size="40MB")
    assert r.chunk_size == 40 * MiB       # rounded up to the 2 MiB granularity
    assert r.peak_reserved_bytes > r.peak_requested_bytes


def test_gpus_and_errors():
    assert {"v100-16gb", "h100-80gb"} <= set(GPUS)
    assert any(k.startswith("a100") for k in GPUS)
    assert get_gpu("V100-16GB") is GPUS["v100-16gb"]
    with pytest.raises(InvalidArgumentError, match="v100-16gb"):
        get_gpu("tpu")
    for g in GPUS.values():
        assert g.sources and g.memory_bytes > 0
    seq, a, b, c = three_functions()
    with pytest.raises(InvalidArgumentError, match="allocator"):
        simulate(seq, swap_schedule(a, b, c), gpu=TOY, allocator="bump")
    with pytest.raises(InvalidArgumentError, match="steps"):
        simulate(seq, Schedule("x", [Step()]), gpu=TOY)


def test_virtual_address_mapping_is_charged_per_call():
    """The swap-in's mapping calls delay the host by exactly what the device's cost model
    prices them at (numbers.md: cuMemMap 1.45 us, cuMemSetAccess 36 us, ...); a warm caching
    allocator makes no calls and pays nothing."""
    seq, a, b, c = three_functions()
    free = simulate(seq, swap_schedule(a, b, c), gpu=TOY, va_costs=False, timeline=True)
    paid = simulate(seq, swap_schedule(a, b, c), gpu=TOY, timeline=True)
    assert free.va_seconds == 0 and free.va_calls == 0
    assert paid.va_calls > 0 and paid.va_seconds > 0
    # f2 starts after the swap-in, which starts after its own mapping calls
    h2d_free, h2d_paid = free.timeline["h2d"][0], paid.timeline["h2d"][0]
    assert h2d_paid[0] > h2d_free[0]
    assert paid.iteration_seconds > free.iteration_seconds
    assert paid.iteration_seconds <= free.iteration_seconds + paid.va_seconds + 1e-12
    warm = simulate(seq, swap_schedule(a, b, c), gpu=TOY, allocator="caching")
    assert warm.va_calls == 0 and warm.va_seconds == 0
    assert warm.iteration_seconds == pytest.approx(free.iteration_seconds)
    assert "link " in paid.summary() and paid.link.startswith(TOY.link or "unnamed")


def test_function_seconds_computed_once_per_sequence_and_gpu():
    """A plan simulates one sequence dozens of times: the durations are computed once per
    (sequence, GPU), and again when the sequence's functions or variables change."""
    from vmalloc.offload.simulation import simulator
    from vmalloc.offload.planning.planner import plan

    seq = FunctionSequence(name="flops", batch=4)
    a = seq.add_variable(GB)
    b = seq.add_variable(GB)
    seq.add_function(inputs=[], outputs=[a], flops=1e11, name="f0")
    seq.add_function(inputs=[a], outputs=[b], flops=2e11, name="f1")
    before = simulator._function_seconds.computed
    p = plan(seq, TOY, "window", "virtual")
    assert p.tried > 5
    assert simulator._function_seconds.computed == before + 1
    assert simulator.function_seconds(seq, TOY) == [0.1, 0.2]
    assert simulator.function_seconds(seq, "v100-16gb") == simulator.function_seconds(
        seq, get_gpu("v100-16gb"))
    assert simulator._function_seconds.computed == before + 2       # one more GPU
    durations = simulator.function_seconds(seq, TOY)
    durations.append(9.0)          # a copy: the cache is not the caller's list
    seq.add_function(inputs=[b], outputs=[a], flops=3e11, name="f2")
    assert simulator.function_seconds(seq, TOY) == [0.1, 0.2, pytest.approx(0.3)]
    seq.variables[a] = seq.variables[a]._replace(nbytes=2 * GB)   # replaced in place
    assert simulator.function_seconds(seq, TOY) == [0.1, 0.2, pytest.approx(0.3)]
    assert simulator._function_seconds.computed == before + 4
