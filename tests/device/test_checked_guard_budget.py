"""Checked mode's guards under the kernel's mapping budget (issue 20, item 4). Each guarded run
of freed pages splits a mapping and costs up to two kernel mappings (vm.max_map_count). Before
the fix every free between live blocks was guarded with no bound: 100k freed 4 KiB blocks
spent the whole budget, and an 8 MiB allocation then failed with DeviceError until
release_cached(). Now at most guard_runs_cap runs are guarded (the oldest opened first), and a
mapping the program needs opens guards rather than fail.

The budget is lowered here (HostDevice.set_vma_limit) so that a few thousand frees reach it."""

import ctypes
import errno
import mmap
import os
import tempfile

import pytest

import vmalloc
from vmalloc import DeviceError, HostDevice

PAGE = mmap.PAGESIZE
KIB = 1 << 10
MIB = 1 << 20


class Probe:
    """Whether a host page can be read, without touching it: write(2) from a PROT_NONE page
    fails with EFAULT instead of faulting (as in test_checked_mode.py)."""

    def __init__(self):
        self.fd, path = tempfile.mkstemp()
        os.unlink(path)

    def readable(self, addr):
        buf = (ctypes.c_char * 1).from_address(addr)
        try:
            os.pwrite(self.fd, memoryview(buf).cast("B"), 0)
            return True
        except OSError as e:
            assert e.errno == errno.EFAULT
            return False

    def close(self):
        os.close(self.fd)


@pytest.fixture
def budget():
    """set(extra): the process may hold `extra` mappings more than now; restored after."""
    limit = HostDevice.vma_limit()
    yield lambda extra: HostDevice.set_vma_limit(HostDevice.process_vmas() + extra)
    HostDevice.set_vma_limit(limit)


def freed_between_live(alloc, n):
    """Allocates 2n 4 KiB blocks and frees every other one: n freed pages, each between two
    live ones, so each is a guarded run of its own. Returns (kept, freed) pointers, in order."""
    blocks = [alloc.allocate(4 * KIB) for _ in range(2 * n)]
    kept, freed = blocks[0::2], blocks[1::2]
    for p in freed:
        alloc.deallocate(p)
    return kept, freed


def test_many_small_frees_stay_under_the_cap_and_a_large_allocation_succeeds(budget):
    dev = HostDevice(capacity="256MiB", checked=True)
    alloc = vmalloc.VirtualAllocator(dev)
    budget(3000)
    cap = dev.state()["guard_runs_cap"]
    assert cap == HostDevice.vma_limit() // 8
    n = 2000  # 4000 mappings of guards unbounded: more than the budget
    kept, freed = freed_between_live(alloc, n)
    s = dev.state()
    # Each free is one run; past the cap the oldest run is opened for each new one.
    assert s["guard_runs"] == cap
    assert s["guards_recycled"] == n - cap
    assert s["bytes_guarded"] == cap * PAGE
    assert s["unguarded_frees"] == 0
    # Failed before the fix: DeviceError, the process would hold more than ... mappings.
    big = alloc.allocate(8 * MIB)
    dev.write(big, b"\x5a" * 64)
    assert dev.read(big, 64) == b"\x5a" * 64
    probe = Probe()
    try:
        # The most recent frees are still guarded; the oldest were opened, but a copy of their
        # bytes is still refused (the device still knows they are freed).
        assert not probe.readable(freed[-1])
        assert probe.readable(freed[0])
        for p in kept[:3] + kept[-3:]:
            assert probe.readable(p)
    finally:
        probe.close()
    with pytest.raises(DeviceError) as e:
        dev.read(freed[0], 16)
    assert e.value.code == 700
    alloc.deallocate(big)
    for p in kept:
        alloc.deallocate(p)


def test_a_mapping_at_the_budget_opens_guards_instead_of_failing(budget):
    dev = HostDevice(capacity="256MiB", checked=True)
    alloc = vmalloc.VirtualAllocator(dev)
    budget(3000)
    cap = dev.state()["guard_runs_cap"]
    kept, freed = freed_between_live(alloc, cap)
    s = dev.state()
    assert (s["guard_runs"], s["guards_recycled"]) == (cap, 0)
    # No room left at all: the next allocation's mappings must come from the guards.
    budget(0)
    big = alloc.allocate(8 * MIB)  # DeviceError before the fix
    s = dev.state()
    opened = s["guards_recycled"]
    assert opened > 0
    assert s["guard_runs"] == cap - opened
    assert s["vmas"] <= HostDevice.vma_limit()
    # Oldest first: the first `opened` frees are open, the rest still guarded.
    probe = Probe()
    try:
        assert probe.readable(freed[opened - 1])
        assert not probe.readable(freed[opened])
        assert not probe.readable(freed[-1])
    finally:
        probe.close()
    alloc.deallocate(big)
    for p in kept:
        alloc.deallocate(p)


@pytest.mark.parametrize("rounds", [1, 3])
def test_guards_recycled_by_allocation_leave_the_queue_bounded(budget, rounds):
    # Frees, then allocations taking the same pages (their guards open), repeated: the
    # recycling queue forgets opened pieces, and the count of runs matches the freed pages.
    dev = HostDevice(capacity="256MiB", checked=True)
    alloc = vmalloc.VirtualAllocator(dev)
    budget(3000)
    cap = dev.state()["guard_runs_cap"]
    kept, freed = freed_between_live(alloc, cap // 2)
    for _ in range(rounds):
        again = [alloc.allocate(4 * KIB) for _ in freed]
        assert sorted(again) == sorted(freed)  # the freed pages taken back
        assert dev.state()["guard_runs"] == 0
        for p in again:
            alloc.deallocate(p)
        assert dev.state()["guard_runs"] == cap // 2
    assert dev.state()["guards_recycled"] == 0
    for p in kept:
        alloc.deallocate(p)
