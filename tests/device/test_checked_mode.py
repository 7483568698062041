"""HostDevice checked mode: memory an allocator freed, or a swap moved away, faults when a
program touches it, on every allocator kind; without checked mode the same touch reads another
buffer's (or stale) bytes, which is what the tests below show can happen."""

import ctypes
import errno
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import vmalloc
from vmalloc import DeviceError, HostDevice, allocator_kinds

PAGE = mmap.PAGESIZE
KIB = 1 << 10
MIB = 1 << 20
KINDS = [k for k in allocator_kinds.NAMES if allocator_kinds.get(k).available]

# The touching program: allocates a buffer, writes it, makes it stale (freed, swapped out, or
# swapped out and swapped in elsewhere), then reads it through the stale pointer.
SCENARIO = textwrap.dedent("""
    import ctypes
    import vmalloc
    from vmalloc import allocator_kinds
    from vmalloc.offload import SwapManager

    def scenario(kind, how, checked, n):
        dev = vmalloc.HostDevice(capacity="256MiB", checked=checked)
        alloc = allocator_kinds.get(kind).make(dev)
        keep = alloc.allocate(n)            # a neighbour that stays live
        p = alloc.allocate(n)
        ctypes.memset(p, 7, n)
        if how == "freed":
            alloc.deallocate(p)
        else:
            swap = SwapManager(alloc)
            key = swap.swap_out(p)
            swap.wait(key)                  # the device memory is released now
            if how == "relocated":
                blocker = alloc.allocate(n) # takes the old place, so the swap-in moves
                q = swap.swap_in(key)
                swap.wait(q)
                dev.synchronize()           # the copy back has landed
                assert q != p, "the swap-in did not relocate"
                assert ctypes.string_at(q, 4) == b"\\x07" * 4
                alloc.deallocate(blocker)   # the old place is free memory again
        print("touching", hex(p), flush=True)
        data = ctypes.string_at(p + n // 2, 4)
        print("read", data.hex(), flush=True)
        return data
""")


def run_program(kind, how, checked, n, tmp_path):
    env = dict(os.environ)
    env.pop("VMALLOC_CHECKED", None)  # the argument decides
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(vmalloc.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    program = SCENARIO + f"scenario({kind!r}, {how!r}, {checked!r}, {n})\n"
    return subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["freed", "swapped", "relocated"])
@pytest.mark.parametrize("kind", KINDS)
def test_touching_stale_memory_faults_loudly_when_checked(kind, how, tmp_path):
    r = run_program(kind, how, True, 64 * KIB, tmp_path)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr)
    assert "touching" in r.stdout and "read" not in r.stdout
    touched = r.stdout.split()[-1]
    # The line names the address touched and the freed allocation it lies in.
    assert "vmalloc: checked HostDevice: the program touched" in r.stderr, r.stderr
    assert f"the allocation [{touched}, " in r.stderr, r.stderr
    assert "(65536 bytes) that its allocator freed or a swap moved" in r.stderr


@pytest.mark.parametrize("how", ["freed", "swapped", "relocated"])
@pytest.mark.parametrize("kind", KINDS)
def test_unchecked_the_same_touch_reads_stale_bytes(kind, how, capsys):
    # What checked mode is for: unchecked, the stale pointer reads memory it does not own (the
    # old bytes, or whatever another buffer wrote there). In this process: it does not fault.
    namespace = {}
    exec(SCENARIO, namespace)
    data = namespace["scenario"](kind, how, False, 64 * KIB)
    assert data == b"\x07" * 4  # the stale buffer's bytes, read through a dangling pointer
    assert "read " in capsys.readouterr().out


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_sized_free_faults_when_checked(kind, tmp_path):
    # Above the small-block threshold too (whole chunks on the virtual allocator).
    r = run_program(kind, "freed", True, 4 * MIB, tmp_path)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr)
    assert "that its allocator freed or a swap moved" in r.stderr


def test_checked_from_the_environment(monkeypatch):
    monkeypatch.setenv("VMALLOC_CHECKED", "1")
    assert HostDevice().checked is True
    assert HostDevice(checked=False).checked is False
    monkeypatch.setenv("VMALLOC_CHECKED", "0")
    assert HostDevice().checked is False
    monkeypatch.delenv("VMALLOC_CHECKED")
    assert HostDevice().checked is False
    assert HostDevice(checked=True).checked is True
    # Accounting only: no memory to guard.
    assert HostDevice(checked=True, backed=False).checked is False
    with pytest.raises(TypeError, match="checked must be a bool or None"):
        HostDevice(checked="yes")


# --- the device's own copies ---------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_copies_of_freed_memory_are_refused(kind):
    dev = HostDevice(checked=True)
    alloc = allocator_kinds.get(kind).make(dev)
    keep = alloc.allocate(64 * KIB)
    p = alloc.allocate(64 * KIB)
    dev.write(p, b"x" * 16)
    assert dev.read(p, 16) == b"x" * 16
    alloc.deallocate(p)
    before = dev.state()
    for op in (lambda: dev.read(p + 100, 16), lambda: dev.write(p, b"y"),
               lambda: dev.copy_device(keep, p, 16), lambda: dev.copy_device(p, keep, 16)):
        with pytest.raises(DeviceError, match=r"in the allocation \[0x[0-9a-f]+, 0x[0-9a-f]+\) "
                                              r"that its allocator freed") as info:
            op()
        assert info.value.code == 700  # CUDA_ERROR_ILLEGAL_ADDRESS, as a GPU would fault
    assert dev.state() == before
    # Allocated again, the bytes are usable again.
    q = alloc.allocate(64 * KIB)
    dev.write(q, b"z" * 16)
    assert dev.read(q, 16) == b"z" * 16
    unchecked = HostDevice(checked=False)
    alloc2 = allocator_kinds.get(kind).make(unchecked)
    alloc2.allocate(64 * KIB)
    r = alloc2.allocate(64 * KIB)
    unchecked.write(r, b"x" * 16)
    alloc2.deallocate(r)
    assert unchecked.read(r, 16) == b"x" * 16  # the stale read checked mode refuses


@pytest.mark.parametrize("kind", KINDS)
def test_copy_queued_before_the_free_still_runs(kind):
    # Stream order: work queued before a free may use the memory, so the copy runs even though
    # the pages are guarded by the time it does (it reads through the memfd).
    dev = HostDevice(checked=True)
    alloc = allocator_kinds.get(kind).make(dev)
    s = dev.create_stream()
    n = 64 * KIB
    p = alloc.allocate(n, stream=s)
    dev.write(p, bytes(range(256)) * (n // 256))
    host = dev.host_alloc(n)
    try:
        hold = dev.hold_stream(s)
        dev.copy_to_host(host, p, n, stream=s)   # pinned: queued, not run
        dev.copy_device(p, p + n // 2, 16, stream=s)  # and a device-to-device copy
        alloc.deallocate(p, stream=s)
        assert dev.state()["bytes_guarded"] >= n - 2 * PAGE
        dev.release_hold(hold)
        dev.synchronize()
        assert ctypes.string_at(host, n) == bytes(range(256)) * (n // 256)
    finally:
        dev.host_free(host)


def test_swap_round_trip_keeps_the_data_in_checked_mode():
    from vmalloc.offload import SwapManager

    for kind in KINDS:
        dev = HostDevice(checked=True)
        alloc = allocator_kinds.get(kind).make(dev)
        swap = SwapManager(alloc)
        ptrs = [alloc.allocate(n) for n in (3 * KIB, 64 * KIB, 3 * MIB)]
        for i, p in enumerate(ptrs):
            dev.write(p, bytes([i + 1]) * 1000)
        keys = [swap.swap_out(p) for p in ptrs]
        back = [swap.swap_in(k) for k in keys]
        dev.synchronize()
        for i, q in enumerate(back):
            assert dev.read(q, 1000) == bytes([i + 1]) * 1000, kind


# --- the property: pages without a live byte are guarded, live bytes are accessible --------

class Probe:
    """Whether a host page can be read, without touching it: write(2) from a PROT_NONE page
    fails with EFAULT instead of faulting."""

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


def device_pages():
    """Pages backed by an emulated device's memory (its memfd) now, from /proc/self/maps."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "vmalloc-host" in parts[5]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def in_ranges(addr, ranges):
    return any(lo <= addr < hi for lo, hi in ranges)


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from([512, 3000, 4096, 5000, 64 * KIB, 100 * KIB,
                                                  1 * MIB + 4096, 3 * MIB])),
    st.tuples(st.just("free"), st.integers(0, 1000))), min_size=1, max_size=30)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_pages_without_a_live_byte_are_guarded(kind, ops):
    dev = HostDevice(capacity="64MiB", checked=True)
    alloc = allocator_kinds.get(kind).make(dev)
    probe = Probe()
    live = {}       # ptr -> size
    touched = {}    # every allocation made: ptr -> size
    try:
        for op, arg in ops:
            address_frees = dev.counters()["free_address"]
            if op == "alloc":
                p = alloc.allocate(arg)
                live[p] = arg
                touched[p] = max(arg, touched.get(p, 0))
            elif live:
                p = sorted(live)[arg % len(live)]
                alloc.deallocate(p)
                del live[p]
            if dev.counters()["free_address"] != address_frees:
                # A reservation went: its addresses start a new life (pages from its old life
                # are not guarded if reserved again), so only the live allocations are checked.
                touched = dict(live)
            assert dev.state()["unguarded_frees"] == 0
            assert dev.state()["live_allocations"] == len(live)
            backed = device_pages()
            live_pages = {a // PAGE * PAGE for p, n in live.items()
                          for a in range(p // PAGE * PAGE, p + n, PAGE)}
            for p, n in touched.items():
                for page in range(p // PAGE * PAGE, p + n, PAGE):
                    if page in live_pages:
                        assert probe.readable(page), (hex(page), "a live byte is guarded")
                    elif in_ranges(page, backed):
                        assert not probe.readable(page), (hex(page), "a freed page is open")
            # Every live byte, the first and the last, is readable.
            for p, n in live.items():
                assert probe.readable(p) and probe.readable(p + n - 1)
    finally:
        probe.close()
