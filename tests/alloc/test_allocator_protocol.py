"""The allocator protocol, checked on every allocator kind and adaptor over every device kind.

Only what every vmalloc allocator promises is tested here (allocator.hpp, vmalloc.Allocator):
live allocations never overlap and keep their bytes, the Stats identities hold after every
call, out-of-memory is vmalloc.OutOfMemoryError with the live state intact, bad input raises
the exact exception and changes nothing, and concurrent callers do not corrupt anything.
Policy details (chunks, segments, rounding) belong to each allocator's own suite.
"""

import bisect
import ctypes
import itertools
import random
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import vmalloc
import vmalloc.allocator_kinds

KiB = 1 << 10
MiB = 1 << 20
CAPACITY = 64 * MiB

# Tiny to several chunks of the default 2 MiB granularity.
SIZES = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(4 * KiB + 1, MiB),
    st.integers(MiB + 1, 12 * MiB),
)


def pattern(tag, n):
    """16 bytes that identify allocation `tag` (a shorter prefix for tiny allocations)."""
    return (tag.to_bytes(4, "little") * 4)[: min(16, n)]


def offsets(n):
    """Where the pattern goes: both ends and a few places between, never overlapping."""
    k = min(16, n)
    result = [0]
    for off in ((n // 3) // 16 * 16, (n // 2) // 16 * 16, n - k):
        if off >= result[-1] + k:
            result.append(off)
    return result


def check_stats(s, requested=None, live=None, capacity=None):
    assert s.internal_fragmentation_bytes == s.allocated_bytes - s.requested_bytes
    assert s.cached_bytes == s.reserved_bytes - s.allocated_bytes
    assert 0 <= s.requested_bytes <= s.allocated_bytes <= s.reserved_bytes
    assert s.peak_requested_bytes >= s.requested_bytes
    assert s.peak_allocated_bytes >= s.allocated_bytes
    assert s.peak_reserved_bytes >= s.reserved_bytes
    assert s.peak_live_allocations >= s.live_allocations
    assert s.live_allocations == s.total_allocations - s.total_deallocations
    if requested is not None:
        assert s.requested_bytes == requested
    if live is not None:
        assert s.live_allocations == live
    if capacity is not None:
        assert s.reserved_bytes <= capacity


def pick(data, items):
    """One of `items`, or None if there are none. Whether an allocation fails can depend on
    where mmap put earlier segments (best fit breaks ties by address), so the live set can
    differ when hypothesis replays an example: draws must not depend on it (no preconditions,
    no sampled_from over live pointers), or hypothesis reports FlakyStrategyDefinition."""
    i = data.draw(st.integers(0, (1 << 16) - 1), label="index")
    return items[i % len(items)] if items else None


#: The adaptors, each run through the whole suite over one upstream kind, as RMM runs its
#: adaptors through its typed suites: an adaptor keeps every promise of the allocator it wraps.
ADAPTORS = {"logging": ("virtual", lambda upstream, path: vmalloc.LoggingAllocator(upstream, path))}


@pytest.fixture(params=[*vmalloc.allocator_kinds.NAMES, *ADAPTORS])
def make_allocator(request, tmp_path):
    """Every allocator kind, then every adaptor over its upstream kind (overrides conftest's
    fixture for this suite only)."""
    if request.param not in ADAPTORS:
        kind = vmalloc.allocator_kinds.get(request.param)
        if not kind.available:
            pytest.skip(f"vmalloc.{kind.class_name} is not built")
        return kind.make
    upstream_kind, adaptor = ADAPTORS[request.param]
    logs = itertools.count()

    def make(device, **options):
        upstream = vmalloc.allocator_kinds.make(upstream_kind, device, **options)
        return adaptor(upstream, tmp_path / f"{request.param}-{next(logs)}.vmtrace")

    make.adaptor = True
    return make


#: Rule executions of the state machine so far, by device name (read by the test below).
OPERATIONS = {}


def run_machine(make_device, make_allocator, max_examples, steps):
    class AllocatorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.device = make_device(capacity=CAPACITY)
            self.allocator = make_allocator(self.device)
            self.live = {}  # ptr -> (nbytes, tag)
            self.starts = []  # sorted starts of live allocations
            self.tag = 0

        def write(self, ptr, n, tag):
            data = pattern(tag, n)
            for off in offsets(n):
                self.device.write(ptr + off, data)

        def verify(self, ptr):
            n, tag = self.live[ptr]
            data = pattern(tag, n)
            for off in offsets(n):
                assert self.device.read(ptr + off, len(data)) == data, (
                    f"allocation {tag} at {ptr:#x}+{off} of {n} bytes was overwritten")

        @rule(n=SIZES, known_size=st.booleans())
        def allocate(self, n, known_size):
            before = self.allocator.stats()
            try:
                ptr = self.allocator.allocate(n)
            except vmalloc.OutOfMemoryError as e:
                assert type(e) is vmalloc.OutOfMemoryError
                assert e.requested_bytes == n and e.stats is not None
                after = self.allocator.stats()
                assert after.out_of_memory_count == before.out_of_memory_count + 1
                assert (after.requested_bytes, after.allocated_bytes, after.live_allocations,
                        after.total_allocations) == (
                    before.requested_bytes, before.allocated_bytes, before.live_allocations,
                    before.total_allocations)
                for p in self.live:  # nothing live was disturbed
                    self.verify(p)
                return
            assert ptr != 0 and ptr % 512 == 0
            i = bisect.bisect(self.starts, ptr)
            if i > 0:
                prev = self.starts[i - 1]
                assert prev + self.live[prev][0] <= ptr, "overlaps the previous allocation"
            if i < len(self.starts):
                assert ptr + n <= self.starts[i], "overlaps the next allocation"
            assert self.allocator.allocation_size(ptr) == n
            self.tag += 1
            self.live[ptr] = (n, self.tag)
            self.starts.insert(i, ptr)
            self.write(ptr, n, self.tag)

        @rule(data=st.data(), known_size=st.booleans())
        def deallocate(self, data, known_size):
            ptr = pick(data, list(self.live))  # in allocation order, not address order
            if ptr is None:
                return
            self.verify(ptr)
            n = self.live[ptr][0]
            self.allocator.deallocate(ptr, n if known_size else None)
            del self.live[ptr]
            self.starts.remove(ptr)

        @rule(data=st.data())
        def read_back(self, data):
            ptr = pick(data, list(self.live))
            if ptr is not None:
                self.verify(ptr)

        @rule()
        def release_cached(self):
            before = self.allocator.stats()
            released = self.allocator.release_cached()
            after = self.allocator.stats()
            assert released == before.reserved_bytes - after.reserved_bytes
            assert (after.requested_bytes, after.allocated_bytes) == (
                before.requested_bytes, before.allocated_bytes)

        @invariant()
        def identities(self):
            name = self.device.name.split(":")[0]
            OPERATIONS[name] = OPERATIONS.get(name, 0) + 1
            check_stats(self.allocator.stats(),
                        requested=sum(n for n, _ in self.live.values()),
                        live=len(self.live), capacity=CAPACITY)

        def teardown(self):
            try:
                for ptr in list(self.live):
                    self.verify(ptr)
                    self.allocator.deallocate(ptr, self.live.pop(ptr)[0])
                self.allocator.release_cached()
                s = self.allocator.stats()
                check_stats(s, requested=0, live=0)
                assert (s.allocated_bytes, s.reserved_bytes) == (0, 0)
            finally:
                # Let the device go even after a failure (emulated devices are reused once
                # idle, also while hypothesis shrinks).
                self.allocator = self.device = None

    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much]))


def test_random_operations_keep_data_and_books(make_device, make_allocator):
    # On the backed HostDevice, 100 examples x 350 steps per allocator kind: with three kinds,
    # over 10**5 operations per run (the floor); 30 x 100 on the driver emulator, which
    # runs the same code under the driver's ABI, and for an adaptor, which forwards to an
    # upstream the full run already covers.
    host = make_device(capacity=CAPACITY).name.startswith("host")
    adaptor = getattr(make_allocator, "adaptor", False)
    examples, steps = (100, 350) if host and not adaptor else (30, 100)
    before = sum(OPERATIONS.values())
    run_machine(make_device, make_allocator, max_examples=examples, steps=steps)
    # The invariant runs once per step: the state machine really ran about as many steps as
    # asked (hypothesis may end an example early, never often).
    assert sum(OPERATIONS.values()) - before >= examples * steps // 2


def test_bad_inputs_raise_exactly_and_change_nothing(make_device, make_allocator):
    dev = make_device(capacity=CAPACITY)
    a = make_allocator(dev)
    big = a.allocate(5 * MiB)
    small = a.allocate(3000)
    freed = a.allocate(4 * MiB)
    a.deallocate(freed)
    stats, calls = a.stats(), dev.counters()["memory_management_calls"]

    def raises(error, call, *args):
        with pytest.raises(error) as info:
            call(*args)
        assert type(info.value) is error, f"{call.__name__}{args} raised {info.value!r}"

    P = vmalloc.InvalidPointerError
    A = vmalloc.InvalidArgumentError
    raises(P, a.deallocate, big + 512)            # interior pointer
    raises(P, a.deallocate, small + 512)          # interior pointer of a small block
    raises(P, a.deallocate, freed)                # double free
    raises(P, a.deallocate, 0x7000_0000_0000)     # never allocated
    raises(P, a.allocation_size, freed)
    raises(P, a.allocation_size, big + 4096)
    raises(A, a.deallocate, big, 5 * MiB + 1)     # size mismatch
    raises(A, a.deallocate, small, 2999)
    raises(A, a.allocate, -1)
    raises(A, a.allocate, (1 << 56) + 1)          # beyond max_request_bytes
    raises(A, a.allocate, "a lot")
    raises(TypeError, a.deallocate, "0x1000")
    raises(TypeError, a.deallocate, -4096)
    assert a.allocate(0) == 0                     # zero bytes: null, nothing counted
    a.deallocate(0)                               # null: a no-op
    assert a.stats() == stats
    assert dev.counters()["memory_management_calls"] == calls
    assert (a.allocation_size(big), a.allocation_size(small)) == (5 * MiB, 3000)
    a.deallocate(big, 5 * MiB)
    a.deallocate(small)
    check_stats(a.stats(), requested=0, live=0)


def test_out_of_memory_at_capacity_then_recovery(make_device, make_allocator):
    dev = make_device(capacity=CAPACITY)
    a = make_allocator(dev)
    n = 12 * MiB  # a whole number of chunks and segments for every allocator
    held = []
    with pytest.raises(vmalloc.OutOfMemoryError) as info:
        for _ in range(CAPACITY // n + 2):
            held.append(a.allocate(n))
    assert len(held) == CAPACITY // n  # 5: everything up to the capacity was served
    e = info.value
    assert type(e) is vmalloc.OutOfMemoryError
    assert e.requested_bytes == n and e.stats.out_of_memory_count == 1
    assert e.stats.requested_bytes == len(held) * n
    before = a.stats()
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.allocate(n)
    after = a.stats()
    assert after.out_of_memory_count == before.out_of_memory_count + 1
    assert (after.requested_bytes, after.allocated_bytes, after.live_allocations) == (
        before.requested_bytes, before.allocated_bytes, before.live_allocations)
    a.deallocate(held.pop())
    held.append(a.allocate(n))  # recovered
    for p in held:
        a.deallocate(p, n)
    a.release_cached()
    assert a.stats().reserved_bytes == 0
    assert dev.physical_bytes_in_use == 0


def test_threads_do_not_corrupt(make_device, make_allocator):
    threads, ops = 8, 10_000
    dev = make_device(capacity=256 * MiB)
    a = make_allocator(dev)
    errors = []
    sizes = [64, 512, 3000, 40 * KiB, 900 * KiB, 3 * MiB]

    def worker(index):
        rng = random.Random(index)
        live = []
        try:
            for op in range(ops):
                if live and (len(live) >= 6 or rng.random() < 0.5):
                    ptr, n, tag = live.pop(rng.randrange(len(live)))
                    if dev.read(ptr, 8) != tag:
                        errors.append(f"thread {index}: {ptr:#x} overwritten")
                    a.deallocate(ptr, n)
                else:
                    n = rng.choice(sizes)
                    try:
                        ptr = a.allocate(n)
                    except vmalloc.OutOfMemoryError:
                        continue
                    tag = (index * ops + op).to_bytes(8, "little")
                    dev.write(ptr, tag)
                    live.append((ptr, n, tag))
            for ptr, n, tag in live:
                if dev.read(ptr, 8) != tag:
                    errors.append(f"thread {index}: {ptr:#x} overwritten")
                a.deallocate(ptr, n)
        except Exception as e:  # reported below, with the thread
            errors.append(f"thread {index}: {e!r}")

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []
    s = a.stats()
    check_stats(s, requested=0, live=0)
    assert s.total_allocations == s.total_deallocations
    a.release_cached()
    assert a.stats().reserved_bytes == 0


# --- stream order on non-blocking streams ---------------------------------------------------


def stream_holder(dev):
    """(hold(stream) -> token, release(token)) for either device kind: a hold blocks a stream
    like a kernel that runs until told to stop (HostDevice.hold_stream, or the driver
    emulator's for a CudaDevice)."""
    if hasattr(dev, "hold_stream"):
        return dev.hold_stream, dev.release_hold
    from vmalloc import testing

    emu = testing.emulator()
    return emu.hold_stream, emu.release_hold


def non_blocking_stream(dev):
    # CudaDevice's streams are CU_STREAM_NON_BLOCKING; HostDevice makes the same on request.
    if isinstance(dev, vmalloc.HostDevice):
        return dev.create_stream(non_blocking=True)
    return dev.create_stream()


@pytest.mark.parametrize("n", [3000, 3 * MiB], ids=["small", "chunks"])
def test_memory_freed_on_a_busy_stream_is_safe_on_another_stream(make_device, make_allocator, n):
    # The last use of x is a copy still queued on stream a (held) when x is freed there. Stream
    # b then gets memory and overwrites it. Whatever the policy (reuse x with b waiting for a's
    # event, or hand out other memory), a's copy must read x's bytes, not b's: on non-blocking
    # streams nothing but the allocator's events orders a and b.
    dev = make_device(capacity=CAPACITY)
    a_ = make_allocator(dev)
    a, b = non_blocking_stream(dev), non_blocking_stream(dev)
    hold, release = stream_holder(dev)
    out, src = dev.host_alloc(16), dev.host_alloc(16)
    try:
        ctypes.memmove(src, b"P2" * 8, 16)
        x = a_.allocate(n, a)
        dev.write(x, b"P1" * 8, a)
        token = hold(a)
        try:
            dev.copy_to_host(out, x, 16, a)  # queued behind the hold
            a_.deallocate(x, n, a)
            y = a_.allocate(n, b)
            dev.copy_to_device(y, src, 16, b)  # would clobber x early if y == x and unordered
        finally:
            release(token)
        dev.synchronize()
        assert ctypes.string_at(out, 16) == b"P1" * 8
        assert dev.read(y, 16) == b"P2" * 8
        a_.deallocate(y, n, b)
        a_.release_cached()
        assert a_.stats().live_allocations == 0
    finally:
        dev.synchronize()
        dev.host_free(out)
        dev.host_free(src)
        dev.destroy_stream(a)
        dev.destroy_stream(b)
