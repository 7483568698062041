"""Every driver call of the swap paths failing once (the driver emulator's fault injection).

For each scenario the calls of one operation are counted in a clean run; then, for every
entry point and every call number k of it, a fresh device, allocator and SwapManager repeat
the warm-up and the operation with the k-th call failing. Each time:

* the operation raises a clear vmalloc error naming the failed call (or tolerates it),
* the allocator's reserved bytes still equal what the device holds for it,
* no data is lost: once the faults are cleared the data reads back, on the device or after a
  successful swap_in,
* nothing leaks: once everything is freed the emulated GPU holds nothing.
"""

import pytest

import vmalloc
from vmalloc import allocator_kinds, offload, testing

MiB = 1 << 20


_PERIOD = bytes((i * 7 + 3) & 0xFF for i in range(256))


def _pattern(size):
    return (_PERIOD * (size // 256 + 1))[:size]


class World:
    def __init__(self, kind, size):
        self.device = testing.emulated_cuda_device(capacity="64MiB", granularity="2MiB")
        self.allocator = allocator_kinds.make(kind, self.device)
        self.swap = offload.SwapManager(self.allocator)
        self.size = size
        self.ptr = self.allocator.allocate(size)
        self.data = _pattern(size)
        self.device.write(self.ptr, self.data)

    def recover(self):
        """Brings the data back to the device, whatever state the fault left; checks it."""
        for _ in range(4):
            state = self.swap.state(self.ptr)
            if state == "swapping_out":
                self.swap.wait(self.ptr)
            elif state == "on_host":
                self.ptr = self.swap.swap_in(self.ptr)
            elif state == "swapping_in":
                self.swap.wait(self.ptr)
                self.device.synchronize()
                self.swap.poll()
            else:
                break
        assert self.swap.state(self.ptr) == "resident"
        assert self.device.read(self.ptr, self.size) == self.data, "data lost"

    def teardown(self, emu):
        ordinal = self.device.ordinal
        self.swap.deallocate(self.ptr)
        self.device.synchronize()
        del self.swap
        self.allocator.release_cached()
        del self.allocator
        state = emu.device_state(ordinal)
        held = {k: state[k] for k in testing.RESOURCE_FIELDS if k != "primary_context_refs"}
        assert not any(held.values()), emu.leak_report(ordinal)
        del self.device


def _out(w):
    w.swap.swap_out(w.ptr)
    w.swap.wait(w.ptr)


def _warm_out(w):
    _out(w)


def _in(w):
    w.ptr = w.swap.swap_in(w.ptr)
    w.swap.wait(w.ptr)
    w.device.synchronize()
    w.swap.poll()


def _out_all(w):
    w.swap.swap_out_all()
    w.swap.wait(w.ptr)


def _in_all(w):
    moved = w.swap.swap_in_all()     # {key: new}; the one allocation
    (w.ptr,) = moved.values()
    w.swap.wait(w.ptr)
    w.device.synchronize()
    w.swap.poll()


# name -> (warm_up(world), operation(world))
SCENARIOS = {
    "swap_out and wait": (lambda w: None, _out),
    "swap_in and wait": (_warm_out, _in),
    "swap_out_all": (lambda w: None, _out_all),
    "swap_in_all": (_warm_out, _in_all),
}


def _calls(emu):
    return {name: emu.call_count(name) for name in testing.FAULTABLE_CALLS}


@pytest.mark.parametrize("size", [5 * MiB, 1000], ids=["chunks", "small"])
@pytest.mark.parametrize("kind", allocator_kinds.NAMES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_driver_call_of_a_swap_failing_once(emu, scenario, kind, size):
    warm_up, operation = SCENARIOS[scenario]
    world = World(kind, size)
    warm_up(world)
    before = _calls(emu)
    operation(world)
    after = _calls(emu)
    world.recover()
    world.teardown(emu)
    sites = [(name, k) for name in testing.FAULTABLE_CALLS for k in range(1, after[name] - before[name] + 1)]
    assert sites

    failures = []
    for name, k in sites:
        world = World(kind, size)
        warm_up(world)
        code = testing.failure_code(name)
        where = f"{scenario}, {kind}, {size} bytes: call {k} of {name} failing with {code}"
        emu.set_fault(name, k, code)
        try:
            operation(world)
            raised = None
        except vmalloc.VmallocError as error:
            raised = error
        except Exception as error:  # noqa: BLE001 - anything else is a bug
            failures.append(f"{where}: raised {type(error).__name__}: {error}")
            raised = error
        emu.clear_faults()
        try:
            if isinstance(raised, vmalloc.DeviceError):
                assert (raised.call, raised.code_name) == (name, code), repr(raised)
            elif isinstance(raised, vmalloc.OutOfMemoryError):
                assert code == "CUDA_ERROR_OUT_OF_MEMORY", repr(raised)
            stats = world.allocator.stats()
            assert stats.reserved_bytes == world.device.physical_bytes_in_use
            world.recover()  # no data lost
            warm_up(world)
            operation(world)  # and the operation now succeeds
            world.recover()
            world.teardown(emu)
        except AssertionError as error:
            failures.append(f"{where}: {error}")
        except Exception as error:  # noqa: BLE001
            failures.append(f"{where}: afterwards {type(error).__name__}: {error}")
    assert not failures, "\n".join(failures)


# --- every pair of faults -------------------------------------------------------------------
# A fault and a second one anywhere in the same operation, its rollback included (the second
# fault ranges over the calls of the run faulted once, so rollback calls such as cuMemUnmap
# after a failed cuMemSetAccess are paired too). Small chunks keep each world cheap: a
# chunk-owning allocation of 3 chunks of 64 KiB, and a small block.

KiB = 1 << 10

PAIR_SCENARIOS = SCENARIOS


class PairWorld(World):
    def __init__(self, kind, size):
        self.device = testing.emulated_cuda_device(capacity="4MiB", granularity="64KiB")
        # 64 KiB chunks for the virtual kinds (their small blocks: up to half a chunk)
        self.allocator = allocator_kinds.make_allocator(kind, self.device, chunk_size="64KiB")
        self.swap = offload.SwapManager(self.allocator)
        self.size = size
        self.ptr = self.allocator.allocate(size)
        self.data = _pattern(size)
        self.device.write(self.ptr, self.data)


def _sites(before, after, skip=()):
    return [(name, k) for name in testing.FAULTABLE_CALLS
            for k in range(1, after[name] - before[name] + 1) if (name, k) not in skip]


def _pairs(emu, kind, size, warm_up, operation):
    """Every unordered pair of call sites: the first from a clean run, the second from the
    run with the first failing."""
    world = PairWorld(kind, size)
    warm_up(world)
    before = _calls(emu)
    operation(world)
    first_sites = _sites(before, _calls(emu))
    world.recover()
    world.teardown(emu)
    pairs = set()
    for first in first_sites:
        world = PairWorld(kind, size)
        warm_up(world)
        before = _calls(emu)
        emu.set_fault(first[0], first[1], testing.failure_code(first[0]))
        try:
            operation(world)
        except vmalloc.VmallocError:
            pass
        emu.clear_faults()
        after = _calls(emu)
        for second in _sites(before, after, skip=(first,)):
            pairs.add(tuple(sorted((first, second))))
        world.recover()
        world.teardown(emu)
    return sorted(pairs)


@pytest.mark.parametrize("size", [160 * KiB, 1000], ids=["chunks", "small"])
@pytest.mark.parametrize("kind", allocator_kinds.NAMES)
@pytest.mark.parametrize("scenario", list(PAIR_SCENARIOS))
def test_every_pair_of_driver_calls_failing(emu, scenario, kind, size):
    """Whatever two calls fail (a rollback's own call included), the data comes back once the
    faults stop, the books agree with the device, and nothing leaks."""
    warm_up, operation = PAIR_SCENARIOS[scenario]
    pairs = _pairs(emu, kind, size, warm_up, operation)
    assert pairs
    failures = []
    for (n1, k1), (n2, k2) in pairs:
        world = PairWorld(kind, size)
        warm_up(world)
        where = f"{scenario}, {kind}, {size} bytes: {n1} #{k1} and {n2} #{k2} failing"
        emu.set_fault(n1, k1, testing.failure_code(n1))
        emu.set_fault(n2, k2, testing.failure_code(n2))
        try:
            operation(world)
        except vmalloc.VmallocError:
            pass
        except Exception as error:  # noqa: BLE001 - anything else is a bug
            failures.append(f"{where}: raised {type(error).__name__}: {error}")
        emu.clear_faults()
        try:
            assert world.allocator.stats().reserved_bytes == world.device.physical_bytes_in_use
            world.recover()  # no data lost
            warm_up(world)
            operation(world)  # and the operation now succeeds
            world.recover()
            world.teardown(emu)
        except AssertionError as error:
            failures.append(f"{where}: {error}")
        except Exception as error:  # noqa: BLE001
            failures.append(f"{where}: afterwards {type(error).__name__}: {error}")
    assert not failures, f"{len(failures)} of {len(pairs)} pairs:\n" + "\n".join(failures)
