"""Every driver call an allocator makes, failed once on purpose (the driver emulator's fault
injection), inside allocate, deallocate and release_cached.

For each scenario the calls of one operation are first counted in a clean run; then, for every
entry point and every call number k of it, a fresh device and allocator repeat the warm-up and
the operation with the k-th call failing. Each time:

* the operation raises a vmalloc error (or tolerates the failure),
* a failed allocate/deallocate leaves the caller-visible accounting unchanged,
* the allocator's reserved bytes still equal the physical memory the device holds for it,
* the allocator keeps working (the operation succeeds on retry; memory reads back),
* nothing leaks: once the allocator is gone the emulated GPU holds nothing.
"""


import pytest

import vmalloc
from vmalloc import testing

MiB = 1 << 20


#: Caller-visible accounting a failed allocate or deallocate must not change.
UNCHANGED = ("requested_bytes", "allocated_bytes", "live_allocations", "total_allocations",
             "total_deallocations", "internal_fragmentation_bytes", "peak_requested_bytes",
             "peak_allocated_bytes", "peak_live_allocations")


class World:
    """A fresh emulated GPU, an allocator on it, and what the scenario holds."""

    def __init__(self, make_allocator, capacity):
        self.device = testing.emulated_cuda_device(capacity=capacity, granularity="2MiB")
        self.allocator = make_allocator(self.device)
        self.live = {}      # ptr -> (size, stream)
        self.streams = []

    def stream(self):
        s = self.device.create_stream()
        self.streams.append(s)
        return s

    def allocate(self, size, stream=0):
        ptr = self.allocator.allocate(size, stream)
        self.live[ptr] = (size, stream)
        return ptr

    def deallocate(self, ptr):
        size, stream = self.live[ptr]
        self.allocator.deallocate(ptr, size, stream)
        del self.live[ptr]


# Each scenario: (capacity, warm_up(world) -> context, operation(world, context)).
def _cold(size):
    return "32MiB", lambda w: None, lambda w, c: w.allocate(size)


def _deallocate():
    return "32MiB", lambda w: w.allocate(5 * MiB), lambda w, p: w.deallocate(p)


def _release_cached():
    def warm(w):
        w.deallocate(w.allocate(5 * MiB))
        w.deallocate(w.allocate(1000))
    return "32MiB", warm, lambda w, c: w.allocator.release_cached()


def _pressure():
    # A 24 MiB device with 12 MiB cached and 20 MiB asked: cached memory must be reclaimed.
    # (20 MiB: the caching allocator's segment for mid-sized requests.)
    return "24MiB", lambda w: w.deallocate(w.allocate(12 * MiB)), lambda w, c: w.allocate(20 * MiB)


def _cross_stream_reuse():
    def warm(w):
        s1, s2 = w.stream(), w.stream()
        w.deallocate(w.allocate(4 * MiB, s1))
        return s2
    return "32MiB", warm, lambda w, s2: w.allocate(4 * MiB, s2)


def _multi_stream_free():
    def warm(w):
        s1, s2 = w.stream(), w.stream()
        w.allocate(2 * MiB, s2)  # the allocator has seen two streams
        return w.allocate(4 * MiB, s1)
    # 48 MiB: the caching allocator gives each stream its own 20 MiB segment.
    return "48MiB", warm, lambda w, p: w.deallocate(p)


def _pressure_multi_stream():
    def warm(w):
        s1, s2 = w.stream(), w.stream()
        w.deallocate(w.allocate(12 * MiB, s1))
        w.deallocate(w.allocate(512 * 1024, s2))
        return s2
    return "24MiB", warm, lambda w, s2: w.allocate(20 * MiB, s2)


SCENARIOS = {
    "allocate cold": _cold(5 * MiB),
    "allocate small cold": _cold(1000),
    "deallocate": _deallocate(),
    "release_cached": _release_cached(),
    "allocate under pressure": _pressure(),
    "allocate on another stream": _cross_stream_reuse(),
    "deallocate with several streams": _multi_stream_free(),
    "allocate under pressure, several streams": _pressure_multi_stream(),
}


def _calls(emu):
    return {name: emu.call_count(name) for name in testing.FAULTABLE_CALLS}


def _held(emu, ordinal):
    state = emu.device_state(ordinal)
    return {k: state[k] for k in testing.RESOURCE_FIELDS if k != "primary_context_refs"}


def _teardown(world, emu):
    """Frees what the scenario holds and drops the allocator; the GPU must then be empty."""
    ordinal = world.device.ordinal
    for ptr in list(world.live):
        world.deallocate(ptr)
    world.allocator.release_cached()
    world.device.synchronize()
    del world.allocator
    for s in world.streams:
        world.device.destroy_stream(s)
    held = _held(emu, ordinal)
    assert not any(held.values()), emu.leak_report(ordinal)
    del world.device


def _accounting(allocator):
    return {k: getattr(allocator.stats(), k) for k in UNCHANGED}


def _consistent(world):
    stats = world.allocator.stats()
    assert stats.reserved_bytes == world.device.physical_bytes_in_use, stats
    assert stats.cached_bytes == stats.reserved_bytes - stats.allocated_bytes


def _still_works(world):
    ptr = world.allocate(3 * MiB)
    world.device.write(ptr + 3 * MiB - 5, b"works")
    assert world.device.read(ptr + 3 * MiB - 5, 5) == b"works"
    small = world.allocate(512)
    world.device.write(small, b"small")
    assert world.device.read(small, 5) == b"small"
    world.deallocate(small)
    world.deallocate(ptr)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_driver_call_failing_once(make_allocator, emu, scenario):
    capacity, warm_up, operation = SCENARIOS[scenario]

    # A clean run counts the calls the operation makes.
    world = World(make_allocator, capacity)
    context = warm_up(world)
    before = _calls(emu)
    result = operation(world, context)
    after = _calls(emu)
    _teardown(world, emu)
    sites = [(name, k) for name in testing.FAULTABLE_CALLS for k in range(1, after[name] - before[name] + 1)]
    if not sites:
        pytest.skip(f"{scenario} makes no driver call with this allocator")

    failures = []
    for name, k in sites:
        world = World(make_allocator, capacity)
        context = warm_up(world)
        accounting = _accounting(world.allocator)
        live = dict(world.live)
        code = testing.failure_code(name)
        emu.set_fault(name, k, code)
        where = f"{scenario}: call {k} of {name} failing with {code}"
        try:
            operation(world, context)
            raised = None
        except vmalloc.VmallocError as error:
            raised = error
        except Exception as error:  # noqa: BLE001 - anything else is a bug to report
            failures.append(f"{where}: raised {type(error).__name__}: {error}")
            raised = error
        emu.clear_faults()
        try:
            if raised is not None:
                if isinstance(raised, vmalloc.DeviceError):
                    assert (raised.call, raised.code_name) == (name, code), repr(raised)
                elif isinstance(raised, vmalloc.OutOfMemoryError):
                    assert code == "CUDA_ERROR_OUT_OF_MEMORY", repr(raised)
                assert world.live == live, "a failed operation changed what is live"
                assert _accounting(world.allocator) == accounting, "accounting changed"
                _consistent(world)
                operation(world, context)  # usable: the same operation now succeeds
            _consistent(world)
            for ptr in list(world.live):  # room for more, on a device the scenario filled
                world.deallocate(ptr)
            _still_works(world)
            _teardown(world, emu)
        except AssertionError as error:
            failures.append(f"{where}: {error}")
        except Exception as error:  # noqa: BLE001
            failures.append(f"{where}: afterwards {type(error).__name__}: {error}")
    assert not failures, "\n".join(failures)


def test_a_failing_context_push_inside_allocate(make_allocator, emu):
    world = World(make_allocator, "32MiB")
    accounting = _accounting(world.allocator)
    with emu.fault("cuCtxPushCurrent", 1, "CUDA_ERROR_INVALID_CONTEXT"):
        with pytest.raises(vmalloc.DeviceError) as info:
            world.allocate(5 * MiB)
    assert info.value.call == "cuCtxPushCurrent"
    assert _accounting(world.allocator) == accounting
    _consistent(world)
    _still_works(world)
    _teardown(world, emu)


def test_out_of_memory_from_the_driver_is_out_of_memory_error(make_allocator, emu):
    world = World(make_allocator, "32MiB")
    with emu.fault("cuMemCreate", 1, "CUDA_ERROR_OUT_OF_MEMORY", count=0):
        with pytest.raises(vmalloc.OutOfMemoryError) as info:
            world.allocate(5 * MiB)
    assert info.value.requested_bytes is not None
    assert world.allocator.stats().out_of_memory_count == 1
    _still_works(world)
    _teardown(world, emu)


# --- double faults: a driver call fails, and so does a call of the rollback ---------------

#: (the call that fails, its number within the operation, the rollback call that fails too).
DOUBLE_FAULTS = [
    ("cuMemSetAccess", 1, "cuMemUnmap"),
    ("cuMemSetAccess", 1, "cuMemAddressFree"),
    ("cuMemMap", 2, "cuMemUnmap"),
    ("cuMemMap", 1, "cuMemAddressFree"),
]

DOUBLE_SCENARIOS = {
    "allocate cold": _cold(5 * MiB),
    "allocate small cold": _cold(1000),
    "allocate under pressure": _pressure(),
}


@pytest.mark.parametrize("scenario", list(DOUBLE_SCENARIOS))
@pytest.mark.parametrize("fault", DOUBLE_FAULTS, ids=lambda f: f"{f[0]}-{f[1]}+{f[2]}")
def test_a_failing_rollback_leaks_nothing(make_allocator, emu, scenario, fault):
    """After a failure whose rollback fails too, the books agree with the device, the
    allocator works on, and destroying it leaves the emulated GPU empty."""
    capacity, warm_up, operation = DOUBLE_SCENARIOS[scenario]
    name, k, rollback = fault
    world = World(make_allocator, capacity)
    context = warm_up(world)
    accounting = _accounting(world.allocator)
    live = dict(world.live)
    emu.set_fault(name, k, "CUDA_ERROR_UNKNOWN")
    emu.set_fault(rollback, 1, "CUDA_ERROR_UNKNOWN")
    try:
        operation(world, context)
        raised = False
    except vmalloc.DeviceError as error:
        # (under pressure the rollback's call may fail first, while stealing)
        assert error.call in (name, rollback), repr(error)
        raised = True
    finally:
        emu.clear_faults()
    if raised:
        assert world.live == live
        assert _accounting(world.allocator) == accounting
    _consistent(world)
    for ptr in list(world.live):
        world.deallocate(ptr)
    _still_works(world)
    _consistent(world)
    ordinal = world.device.ordinal
    # Destroying the allocator (without release_cached) must tear down what it kept.
    del world.allocator
    world.device.synchronize()
    for s in world.streams:
        world.device.destroy_stream(s)
    held = _held(emu, ordinal)
    assert not any(held.values()), emu.leak_report(ordinal)
