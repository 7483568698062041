"""Streams that the driver emulator used to forgive and a GPU does not.

* A stream destroyed by its owner is never used again by an allocator (its handle is
  undefined on a GPU); the emulator refuses such a use and lists it in its leak report.
* CU_STREAM_PER_THREAD (0x2) is a different stream on each host thread, in the emulator and in
  the allocators' stream ordering (the virtual allocators' and the caching allocator's pools).
"""

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import vmalloc
from vmalloc import testing

MiB = 1 << 20
PER_THREAD = 0x2


def _misuses(emu, dev):
    return [line for line in emu.leak_report(dev.ordinal).splitlines() if "misuse" in line]


def test_emulator_refuses_and_reports_a_destroyed_stream(emu):
    dev = testing.emulated_cuda_device(capacity="64MiB")
    s = dev.create_stream()
    dev.destroy_stream(s)
    with pytest.raises(vmalloc.DeviceError) as info:
        dev.synchronize_stream(s)
    assert info.value.code_name == "CUDA_ERROR_INVALID_HANDLE"
    assert "destroyed" in str(info.value)
    assert any(hex(s) in line for line in _misuses(emu, dev)), emu.leak_report(dev.ordinal)


@pytest.mark.parametrize("placement", ["chunks", "packed"])
@pytest.mark.parametrize("then", ["allocate on another stream", "release_cached",
                                  "allocate under pressure"])
def test_allocators_never_touch_a_destroyed_freeing_stream(emu, placement, then):
    dev = testing.emulated_cuda_device(capacity="16MiB")
    misuses = _misuses(emu, dev)  # those of earlier tests on this device
    va = vmalloc.VirtualAllocator(dev, placement=placement)
    a, b = dev.create_stream(), dev.create_stream()
    x = va.allocate(3 * MiB, a)
    small = va.allocate(1000, a)
    va.deallocate(x, 3 * MiB, a)  # a single stream so far: no event recorded at free
    va.deallocate(small, 1000, a)
    dev.destroy_stream(a)
    if then == "allocate on another stream":
        va.allocate(3 * MiB, b)
        va.allocate(1000, b)
    elif then == "release_cached":
        va.release_cached()
    else:
        va.allocate(14 * MiB, b)  # must unmap the cached memory freed on `a`
    assert _misuses(emu, dev) == misuses
    dev.synchronize()
    del va
    dev.destroy_stream(b)


def test_emulator_per_thread_streams_are_distinct(emu):
    dev = testing.emulated_cuda_device(capacity="64MiB")
    emu.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    emu.lib.cuCtxPopCurrent_v2.argtypes = [ctypes.c_void_p]
    held = {}
    finish = threading.Event()

    def hold_mine():  # stays alive meanwhile: its per-thread stream is its own
        assert emu.lib.cuCtxPushCurrent_v2(dev.context) == 0
        held["token"] = emu.hold_stream(PER_THREAD)
        emu.lib.cuCtxPopCurrent_v2(None)
        finish.wait(20)

    t = threading.Thread(target=hold_mine, daemon=True)
    t.start()
    for _ in range(1000):
        if "token" in held:
            break
        threading.Event().wait(0.01)
    assert "token" in held
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (dev.synchronize_stream(PER_THREAD), done.set()),
                              daemon=True)
    try:
        waiter.start()
        # This thread's per-thread stream is not the held one: its synchronize returns.
        assert done.wait(10), "another thread's per-thread stream was the held one"
    finally:
        emu.release_hold(held["token"])
        finish.set()
        waiter.join(10)
        t.join(10)


@pytest.mark.parametrize("placement", ["chunks", "packed"])
def test_per_thread_stream_is_one_stream_per_thread_in_allocators(placement):
    dev = testing.emulated_cuda_device(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev, placement=placement)
    out = {}

    def run(name):
        p = va.allocate(3 * MiB, PER_THREAD)
        va.deallocate(p, 3 * MiB, PER_THREAD)
        out[name] = p

    for name in ("one", "two"):
        t = threading.Thread(target=run, args=(name,))
        t.start()
        t.join(10)
    stats = va.packed_stats() if placement == "packed" else va.chunk_stats()
    assert stats["multi_stream"], "two threads' CU_STREAM_PER_THREAD were taken as one stream"
    del va
    dev.synchronize()


def _hold_my_per_thread_stream(emu, dev):
    """Holds the calling thread's CU_STREAM_PER_THREAD (work still running on it)."""
    emu.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    emu.lib.cuCtxPopCurrent_v2.argtypes = [ctypes.c_void_p]
    assert emu.lib.cuCtxPushCurrent_v2(dev.context) == 0
    try:
        return emu.hold_stream(PER_THREAD)
    finally:
        emu.lib.cuCtxPopCurrent_v2(None)


@pytest.mark.parametrize("expandable", [False, True])
def test_caching_allocator_pools_per_thread_streams_apart(emu, expandable):
    # PyTorch's pools are keyed by stream: a block freed on thread A's per-thread stream is
    # A's, and thread B's per-thread stream (another stream with the same handle) never takes
    # it while A's work may still use it.
    dev = testing.emulated_cuda_device(capacity="64MiB")
    ca = vmalloc.CachingAllocator(dev, expandable_segments=expandable)
    with ThreadPoolExecutor(1) as thread_a:  # one thread throughout: one per-thread stream
        p = thread_a.submit(ca.allocate, MiB, PER_THREAD).result()
        token = thread_a.submit(_hold_my_per_thread_stream, emu, dev).result()
        try:
            thread_a.submit(ca.deallocate, p, MiB, PER_THREAD).result()
            q = ca.allocate(MiB, PER_THREAD)  # this thread's per-thread stream
            assert q != p, "thread B's CU_STREAM_PER_THREAD took thread A's freed block"
            assert ca.segment_stats()["small_segments"] == 2
            assert [s["stream"] for s in ca.snapshot()] == [PER_THREAD, PER_THREAD]
            # On its own stream, thread A reuses the block at once.
            assert thread_a.submit(ca.allocate, MiB, PER_THREAD).result() == p
        finally:
            emu.release_hold(token)
    dev.synchronize()
    del ca


def test_caching_allocator_orders_a_free_on_another_threads_per_thread_stream(emu):
    # Allocated on thread A's per-thread stream, freed on thread B's: B's work queued before
    # the free must complete before A reuses the block.
    dev = testing.emulated_cuda_device(capacity="64MiB")
    ca = vmalloc.CachingAllocator(dev)
    with ThreadPoolExecutor(1) as thread_a:
        p = thread_a.submit(ca.allocate, MiB, PER_THREAD).result()
        token = _hold_my_per_thread_stream(emu, dev)  # this thread is B
        try:
            ca.deallocate(p, MiB, PER_THREAD)
            seg = ca.segment_stats()
            assert (seg["waiting_blocks"], seg["waiting_bytes"]) == (1, MiB)
            q = thread_a.submit(ca.allocate, MiB, PER_THREAD).result()
            assert q == p + MiB, "the block freed on another stream was reused without waiting"
        finally:
            emu.release_hold(token)
        dev.synchronize()
        assert thread_a.submit(ca.allocate, MiB, PER_THREAD).result() == p
        assert ca.segment_stats()["waiting_blocks"] == 0
    del ca


def test_caching_allocator_record_stream_of_another_threads_per_thread_stream(emu):
    # record_stream(PER_THREAD) on thread B, free on thread A: A cannot name B's per-thread
    # stream (0x2 on A is A's own), so the free waits for the whole device instead.
    dev = testing.emulated_cuda_device(capacity="64MiB")
    ca = vmalloc.CachingAllocator(dev)
    with ThreadPoolExecutor(1) as thread_a:
        p = thread_a.submit(ca.allocate, MiB, PER_THREAD).result()
        ca.record_stream(p, PER_THREAD)
        before = emu.call_count("cuCtxSynchronize")
        thread_a.submit(ca.deallocate, p, MiB, PER_THREAD).result()
        assert emu.call_count("cuCtxSynchronize") == before + 1
        assert ca.segment_stats()["waiting_blocks"] == 0
        assert thread_a.submit(ca.allocate, MiB, PER_THREAD).result() == p
    del ca
    dev.synchronize()
