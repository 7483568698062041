"""HostDevice streams, events and asynchronous copies.

Queued work is made observable without timing: ``hold_stream`` blocks a stream until
released, so "not yet run" is a certainty, not a race.
"""

import ctypes
import gc
import threading

import pytest

from vmalloc import DeviceError, HostDevice

MiB = 1 << 20
G = 2 * MiB
INVALID_HANDLE = 400
ILLEGAL_ADDRESS = 700


@pytest.fixture
def dev():
    return HostDevice()


def mapped(dev, size):
    h = dev.create(size)
    p = dev.reserve(size)
    dev.map(p, size, h)
    dev.set_access(p, size)
    return p


def pinned(dev, data):
    """Pinned host memory holding ``data``; returns (address, ctypes view)."""
    addr = dev.host_alloc(len(data))
    view = (ctypes.c_char * len(data)).from_address(addr)
    view.raw = data
    return addr, view


# --- ordering on one stream ---------------------------------------------------------------

@pytest.mark.parametrize("stream_kind", ["default", "created"])
def test_copies_on_one_stream_run_in_order(dev, stream_kind):
    s = 0 if stream_kind == "default" else dev.create_stream()
    p = mapped(dev, G)
    src = [pinned(dev, bytes([i]) * 4096) for i in range(8)]
    hold = dev.hold_stream(s)
    for i, (addr, _) in enumerate(src):
        # Each value goes through the same staging slot, then is copied to its own slot:
        # only strict order leaves slot i holding value i.
        dev.copy_to_device(p, addr, 4096, s)
        dev.copy_device(p + (i + 1) * 4096, p, 4096, s)
    dev.release_hold(hold)
    dev.synchronize_stream(s)
    for i in range(8):
        assert dev.read(p + (i + 1) * 4096, 4096) == bytes([i]) * 4096


def test_pinned_copy_to_host_is_asynchronous(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    dev.write(p, b"payload!")
    addr, view = pinned(dev, b"\0" * 8)
    hold = dev.hold_stream(s)
    dev.copy_to_host(addr, p, 8, s)  # returns although the stream cannot run yet
    assert view.raw == b"\0" * 8
    dev.release_hold(hold)
    dev.synchronize_stream(s)
    assert view.raw == b"payload!"


def test_pageable_copy_to_device_takes_bytes_at_the_call(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    buf = ctypes.create_string_buffer(b"original", 8)
    hold = dev.hold_stream(s)
    dev.copy_to_device(p, ctypes.addressof(buf), 8, s)
    buf.raw = b"changed!"  # the caller may reuse pageable memory at once
    dev.release_hold(hold)
    dev.synchronize_stream(s)
    assert dev.read(p, 8) == b"original"


def test_pageable_copy_to_host_waits(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    dev.write(p, b"sync")
    buf = ctypes.create_string_buffer(4)
    dev.copy_to_host(ctypes.addressof(buf), p, 4, s)
    assert buf.raw == b"sync"  # no synchronize needed


# --- events -------------------------------------------------------------------------------

def test_event_never_recorded_is_complete(dev):
    e = dev.create_event()
    assert dev.query_event(e) is True
    dev.synchronize_event(e)


def test_event_captures_queued_work(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    addr, _ = pinned(dev, b"E" * 64)
    e = dev.create_event()
    hold = dev.hold_stream(s)
    dev.copy_to_device(p, addr, 64, s)
    dev.record_event(e, s)
    assert dev.query_event(e) is False
    dev.release_hold(hold)
    dev.synchronize_event(e)
    assert dev.query_event(e) is True
    assert dev.read(p, 64) == b"E" * 64


def test_event_record_captures_only_earlier_work(dev):
    s = dev.create_stream()
    e = dev.create_event()
    dev.record_event(e, s)  # nothing queued yet: complete at once
    hold = dev.hold_stream(s)
    assert dev.query_event(e) is True
    dev.record_event(e, s)  # re-recording captures the hold
    assert dev.query_event(e) is False
    dev.release_hold(hold)
    dev.synchronize_event(e)
    assert dev.query_event(e) is True


def test_synchronize_event_blocks_until_done(dev):
    s = dev.create_stream()
    e = dev.create_event()
    hold = dev.hold_stream(s)
    dev.record_event(e, s)
    finished = threading.Event()

    def waiter():
        dev.synchronize_event(e)
        finished.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not finished.is_set()  # cannot be: the hold is still in place
    dev.release_hold(hold)
    t.join()
    assert finished.is_set()


def test_wait_event_orders_streams(dev):
    producer = dev.create_stream()
    consumer = dev.create_stream()
    p = mapped(dev, G)
    addr, _ = pinned(dev, b"P" * 4096)
    ready = dev.create_event()
    done = dev.create_event()
    hold = dev.hold_stream(producer)
    dev.copy_to_device(p, addr, 4096, producer)
    dev.record_event(ready, producer)
    dev.wait_event(consumer, ready)
    dev.copy_device(p + 4096, p, 4096, consumer)
    dev.record_event(done, consumer)
    assert dev.query_event(done) is False  # the consumer waits for the held producer
    dev.release_hold(hold)
    dev.synchronize_stream(consumer)
    assert dev.query_event(done) is True
    assert dev.read(p + 4096, 4096) == b"P" * 4096


def test_wait_event_on_its_own_stream_is_harmless(dev):
    s = dev.create_stream()
    e = dev.create_event()
    hold = dev.hold_stream(s)
    dev.record_event(e, s)
    dev.wait_event(s, e)
    dev.release_hold(hold)
    dev.synchronize_stream(s)
    assert dev.query_event(e) is True


def test_default_stream_waits_for_other_streams(dev):
    s = dev.create_stream()
    e = dev.create_event()
    hold = dev.hold_stream(s)
    dev.record_event(e, 0)  # the legacy default stream waits for earlier work everywhere
    assert dev.query_event(e) is False
    dev.release_hold(hold)
    dev.synchronize()
    assert dev.query_event(e) is True


@pytest.mark.parametrize("idle_by", ["synchronize", "default-stream work"])
def test_default_stream_waits_for_a_stream_busy_again_after_it_went_idle(dev, idle_by):
    # The device visits only streams with work not yet seen complete (so that 100 k streams
    # replay in linear time); a stream that went idle, was dropped from that set, and got work
    # again must order the default stream and synchronize() again.
    streams = [dev.create_stream() for _ in range(50)]
    for s in streams:
        dev.record_event(dev.create_event(), s)
    if idle_by == "synchronize":
        dev.synchronize()
    else:
        e0 = dev.create_event()
        dev.record_event(e0, 0)      # waits for every busy stream, then prunes them
        dev.synchronize_event(e0)
        dev.record_event(dev.create_event(), 0)
    s = streams[17]
    hold = dev.hold_stream(s)
    e = dev.create_event()
    dev.record_event(e, 0)
    assert dev.query_event(e) is False
    waiter = threading.Thread(target=dev.synchronize)
    waiter.start()
    waiter.join(0.5)                 # a correct synchronize() is still waiting for the hold
    assert waiter.is_alive()
    dev.release_hold(hold)
    waiter.join()
    assert dev.query_event(e) is True


def test_other_streams_wait_for_default_stream(dev):
    s = dev.create_stream()
    e = dev.create_event()
    hold = dev.hold_stream(0)
    dev.record_event(e, s)
    assert dev.query_event(e) is False
    dev.release_hold(hold)
    dev.synchronize_event(e)
    assert dev.query_event(e) is True


def completes_while_held(dev, hold, wait):
    """Runs ``wait()`` in a thread while ``hold`` blocks a stream; True if it returned before
    the hold was released. The bound only turns a wrongful wait into a failure instead of a
    hang: a correct device returns at once."""
    done = threading.Event()
    t = threading.Thread(target=lambda: (wait(), done.set()))
    t.start()
    t.join(60)
    returned = done.is_set()
    dev.release_hold(hold)
    t.join()
    return returned


def test_non_blocking_stream_does_not_wait_for_default_stream(dev):
    s = dev.create_stream(non_blocking=True)
    e = dev.create_event()
    hold = dev.hold_stream(0)
    dev.record_event(e, s)
    assert completes_while_held(dev, hold, lambda: dev.synchronize_event(e))


def test_default_stream_does_not_wait_for_non_blocking_stream(dev):
    s = dev.create_stream(non_blocking=True)
    e = dev.create_event()
    hold = dev.hold_stream(s)
    dev.record_event(e, 0)
    assert completes_while_held(dev, hold, lambda: dev.synchronize_event(e))


def test_blocking_and_non_blocking_streams_together(dev):
    blocking = dev.create_stream()
    free = dev.create_stream(non_blocking=True)
    p = mapped(dev, G)
    e_blocking, e_free = dev.create_event(), dev.create_event()
    hold = dev.hold_stream(0)
    dev.record_event(e_blocking, blocking)  # waits for the held default stream
    dev.write(p, b"free", stream=free)      # blocking write: returns, free does not wait
    dev.record_event(e_free, free)
    dev.synchronize_event(e_free)
    assert dev.query_event(e_blocking) is False
    dev.release_hold(hold)
    dev.synchronize_event(e_blocking)
    assert dev.read(p, 4) == b"free"
    assert dev.state()["streams"] == 2
    dev.destroy_stream(free)
    dev.destroy_stream(blocking)
    assert dev.state()["streams"] == 0


def test_synchronize_stream_waits_only_for_that_stream(dev):
    held = dev.create_stream()
    free = dev.create_stream()
    on_held, on_free = dev.create_event(), dev.create_event()
    hold = dev.hold_stream(held)
    dev.record_event(on_held, held)
    dev.record_event(on_free, free)
    dev.synchronize_stream(free)  # returns: only the held stream is blocked
    assert dev.query_event(on_free) is True
    assert dev.query_event(on_held) is False  # not waited for, still queued
    dev.release_hold(hold)
    dev.synchronize()
    assert dev.query_event(on_held) is True


# --- handles ------------------------------------------------------------------------------

def test_unknown_handles_are_invalid_handle(dev):
    s = dev.create_stream()
    e = dev.create_event()
    p = mapped(dev, G)
    bogus = 0xDEAD
    calls = [
        (lambda: dev.destroy_stream(bogus), "cuStreamDestroy"),
        (lambda: dev.destroy_stream(0), "cuStreamDestroy"),
        (lambda: dev.destroy_event(bogus), "cuEventDestroy"),
        (lambda: dev.record_event(bogus, s), "cuEventRecord"),
        (lambda: dev.record_event(e, bogus), "cuEventRecord"),
        (lambda: dev.record_event(s, e), "cuEventRecord"),  # a stream is not an event
        (lambda: dev.query_event(bogus), "cuEventQuery"),
        (lambda: dev.synchronize_event(bogus), "cuEventSynchronize"),
        (lambda: dev.wait_event(bogus, e), "cuStreamWaitEvent"),
        (lambda: dev.wait_event(s, bogus), "cuStreamWaitEvent"),
        (lambda: dev.synchronize_stream(bogus), "cuStreamSynchronize"),
        (lambda: dev.copy_device(p, p + 64, 8, bogus), "cuMemcpyDtoDAsync"),
        (lambda: dev.release_hold(12345), "HostDevice::release_hold"),
    ]
    before = dev.state()
    for fn, call in calls:
        with pytest.raises(DeviceError) as info:
            fn()
        assert (info.value.call, info.value.code) == (call, INVALID_HANDLE), call
    assert dev.state() == before
    assert dev.counters()["bytes_device"] == 0


def test_create_destroy_counts(dev):
    streams = [dev.create_stream() for _ in range(3)]
    events = [dev.create_event() for _ in range(2)]
    assert len(set(streams + events)) == 5  # one handle space: never confused
    assert (dev.state()["streams"], dev.state()["events"]) == (3, 2)
    for s in streams:
        dev.destroy_stream(s)
    for e in events:
        dev.destroy_event(e)
    c = dev.counters()
    assert (c["stream_create"], c["stream_destroy"], c["event_create"],
            c["event_destroy"]) == (3, 3, 2, 2)
    assert (dev.state()["streams"], dev.state()["events"]) == (0, 0)


def test_destroyed_stream_finishes_its_work(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    addr, _ = pinned(dev, b"late" * 16)
    e = dev.create_event()
    hold = dev.hold_stream(s)
    dev.copy_to_device(p, addr, 64, s)
    dev.record_event(e, s)
    dev.destroy_stream(s)  # returns at once; the queued work still runs
    with pytest.raises(DeviceError):
        dev.copy_device(p, p + 64, 8, s)
    dev.release_hold(hold)
    dev.synchronize_event(e)
    assert dev.read(p, 64) == b"late" * 16


# --- faults at execution time -------------------------------------------------------------

def test_unmapped_before_execution_is_a_sticky_error(dev):
    s = dev.create_stream()
    h = dev.create(G)
    p = dev.reserve(G)
    dev.map(p, G, h)
    dev.set_access(p, G)
    addr, view = pinned(dev, b"\0" * 16)
    hold = dev.hold_stream(s)
    dev.copy_to_host(addr, p, 16, s)  # valid now...
    dev.unmap(p, G)                   # ...not any more when it runs
    dev.release_hold(hold)
    with pytest.raises(DeviceError, match="cuMemcpyDtoHAsync.*not mapped") as info:
        dev.synchronize()
    assert (info.value.call, info.value.code) == ("cuCtxSynchronize", ILLEGAL_ADDRESS)
    assert hex(p) in str(info.value)
    assert view.raw == b"\0" * 16  # the worker never touched the unmapped address
    dev.synchronize()  # reported once; the device stays usable
    dev.map(p, G, h)
    dev.set_access(p, G)
    dev.write(p, b"ok")
    assert dev.read(p, 2) == b"ok"


def test_fault_reported_by_stream_synchronize(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    hold = dev.hold_stream(s)
    dev.copy_device(p + 4096, p, 4096, s)
    dev.unmap(p, G)
    dev.release_hold(hold)
    with pytest.raises(DeviceError) as info:
        dev.synchronize_stream(s)
    assert (info.value.call, info.value.code) == ("cuStreamSynchronize", ILLEGAL_ADDRESS)


def test_pinned_memory_freed_before_execution_is_a_fault(dev):
    s = dev.create_stream()
    p = mapped(dev, G)
    addr, _ = pinned(dev, b"x" * 64)
    hold = dev.hold_stream(s)
    dev.copy_to_device(p, addr, 64, s)
    dev.host_free(addr)
    dev.release_hold(hold)
    with pytest.raises(DeviceError, match="was freed") as info:
        dev.synchronize()
    assert info.value.code == ILLEGAL_ADDRESS


def _memfd_mappings():
    with open("/proc/self/maps") as maps:
        return sum("memfd:" in line for line in maps)


def test_destroying_a_device_with_held_and_queued_work():
    gc.collect()  # devices of earlier tests go now, not during this one
    before = _memfd_mappings()
    dev = HostDevice()
    s = dev.create_stream()
    p = mapped(dev, G)
    addr, _ = pinned(dev, b"y" * 64)
    dev.hold_stream(s)
    dev.copy_to_device(p, addr, 64, s)
    queued = dev.create_event()
    dev.record_event(queued, s)
    assert dev.query_event(queued) is False  # the copy is held, still queued
    assert _memfd_mappings() > before
    del dev  # releases the hold, drains, unmaps: no hang (pytest-timeout), no crash
    assert _memfd_mappings() <= before  # the device's memory is gone with it


# --- threads ------------------------------------------------------------------------------

def test_threads_with_their_own_streams():
    dev = HostDevice(granularity=64 * 1024)
    errors = []

    def worker(i):
        try:
            s = dev.create_stream()
            p = mapped(dev, 4 * dev.granularity)
            addr, view = pinned(dev, bytes([i]) * 1000)
            for _ in range(20):
                dev.copy_to_device(p, addr, 1000, s)
                dev.copy_device(p + 5000, p, 1000, s)
                dev.copy_to_host(addr, p + 5000, 1000, s)
            dev.synchronize_stream(s)
            assert view.raw == bytes([i]) * 1000
            dev.destroy_stream(s)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    c = dev.counters()
    assert (c["copy_to_device"], c["copy_device"], c["copy_to_host"]) == (120, 120, 120)
    assert c["bytes_to_device"] == 120 * 1000
