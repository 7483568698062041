"""Which thread runs a HostDevice copy: a pageable copy on a stream with nothing queued or to
wait for runs on the caller's thread; everything else is handed to the stream's thread.

Handing a blocking read or write to the stream's thread cost two thread wakeups (66 us a
16-byte read on an idle machine): the allocator protocol test's 2.3 million reads took 134-184
s alone or on CI. Counted here as the threads a fresh device starts (each stream starts its
thread with its first queued item), not timed.
"""

import ctypes
import os
import threading

from vmalloc import HostDevice

MiB = 1 << 20
G = 2 * MiB


def thread_ids():
    return set(os.listdir("/proc/self/task"))


def mapped(dev, size):
    h = dev.create(size)
    p = dev.reserve(size)
    dev.map(p, size, h)
    dev.set_access(p, size)
    return p


def test_blocking_reads_and_writes_on_idle_streams_start_no_thread():
    dev = HostDevice()
    p = mapped(dev, G)
    created = dev.create_stream()
    buf = ctypes.create_string_buffer(16)
    before = thread_ids()
    for i in range(200):
        for s in (0, created):
            data = i.to_bytes(4, "little") * 4
            dev.write(p + 64 * i, data, stream=s)
            assert dev.read(p + 64 * i, 16, stream=s) == data
            dev.copy_to_host(ctypes.addressof(buf), p + 64 * i, 16, s)  # pageable: waits
            assert buf.raw == data
            dev.copy_to_device(p + 64 * i + 16, ctypes.addressof(buf), 16, s)
    dev.synchronize()
    assert thread_ids() - before == set()  # was {stream 0's thread, the created stream's}
    c = dev.counters()
    assert (c["copy_to_device"], c["copy_to_host"]) == (800, 800)
    assert (c["bytes_to_device"], c["bytes_to_host"]) == (800 * 16, 800 * 16)
    assert dev.read(p + 64 * 199 + 16, 16) == (199).to_bytes(4, "little") * 4


def test_copies_that_must_wait_still_go_to_the_stream_thread():
    dev = HostDevice()
    p = mapped(dev, G)
    dev.write(p, b"old!")
    s = dev.create_stream()
    src = dev.host_alloc(4)
    try:
        ctypes.memmove(src, b"new!", 4)
        hold = dev.hold_stream(s)
        dev.copy_to_device(p, src, 4, s)  # pinned, queued behind the hold
        # On the default stream a blocking read waits for the blocking stream's earlier work:
        # run at once on this thread it would read "old!".
        result = []
        reader = threading.Thread(target=lambda: result.append(dev.read(p, 4)))
        reader.start()
        reader.join(0.2)
        assert result == []  # still waiting for the held stream
        dev.release_hold(hold)
        reader.join()
        assert result == [b"new!"]
        # A pageable copy behind queued work is queued too, and takes its bytes at the call.
        hold = dev.hold_stream(s)
        buf = ctypes.create_string_buffer(b"late", 4)
        dev.copy_to_device(p, ctypes.addressof(buf), 4, s)
        buf.raw = b"gone"
        assert dev.read(p, 4, stream=dev.create_stream(non_blocking=True)) == b"new!"
        dev.release_hold(hold)
        dev.synchronize()
        assert dev.read(p, 4) == b"late"
    finally:
        dev.synchronize()
        dev.host_free(src)
