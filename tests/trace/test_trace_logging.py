"""LoggingAllocator: records a session of any allocator to .vmtrace; reading it back gives
exactly the calls that were made."""

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.traces import ALLOC, FREE, open_trace

MiB = 1 << 20


def as_tuples(batch):
    return [(int(x["op"]), int(x["stream"]), int(x["addr"]), int(x["size"])) for x in batch]


@pytest.fixture
def upstream(make_allocator):
    return make_allocator(vmalloc.HostDevice(capacity="256MiB", backed=False))


def test_records_a_session_exactly(upstream, tmp_path):
    path = tmp_path / "session.vmtrace"
    stream = upstream.device.create_stream() if hasattr(upstream.device, "create_stream") else 0
    with vmalloc.LoggingAllocator(upstream, path) as log:
        assert log.name == "logging:" + upstream.name
        assert log.device is upstream.device
        a = log.allocate(3 * MiB)
        b = log.allocate("1000", stream=stream)
        assert log.allocate(0) == 0  # not an allocation: not recorded
        assert log.allocation_size(b) == 1000
        log.deallocate(a)
        c = log.allocate(5 * MiB)
        log.deallocate(b, 1000, stream=stream)
        log.deallocate(0)  # a no-op: not recorded
        assert log.stats() == upstream.stats()
        assert log.stats().live_allocations == 1
        assert log.events_written == 5
    assert log.closed
    trace = open_trace(path)
    assert trace.info.metadata["created_by"] == "vmalloc::LoggingAllocator"
    assert trace.info.metadata["allocator"] == upstream.name
    assert trace.info.metadata["consistent"] is True
    assert as_tuples(trace.events()) == [
        (ALLOC, 0, a, 3 * MiB),
        (ALLOC, stream, b, 1000),
        (FREE, 0, a, 3 * MiB),  # the size comes from the recorded allocation
        (ALLOC, 0, c, 5 * MiB),
        (FREE, stream, b, 1000),
    ]
    assert trace.info.live_at_end == 1
    upstream.deallocate(c)


def test_failures_are_not_recorded_and_change_nothing(upstream, tmp_path):
    path = tmp_path / "t.vmtrace"
    log = vmalloc.LoggingAllocator(upstream, path)
    a = log.allocate(MiB)
    before = upstream.stats()
    with pytest.raises(vmalloc.OutOfMemoryError):
        log.allocate("1GiB")  # more than the 256 MiB device
    with pytest.raises(vmalloc.InvalidPointerError):
        log.deallocate(a + 12345)
    with pytest.raises(vmalloc.InvalidPointerError):
        log.deallocate(0xDEAD0000)
    assert log.failed_allocations == 1
    assert log.events_written == 1
    assert upstream.stats().live_allocations == before.live_allocations
    log.deallocate(a)
    log.close()
    assert as_tuples(open_trace(path).events()) == [(ALLOC, 0, a, MiB), (FREE, 0, a, MiB)]


def test_allocations_made_before_wrapping(upstream, tmp_path):
    early = upstream.allocate(MiB)
    path = tmp_path / "t.vmtrace"
    with vmalloc.LoggingAllocator(upstream, path) as log:
        late = log.allocate(2 * MiB)
        log.deallocate(early)  # forwarded, but its allocation is not in the trace
        log.deallocate(late)
        assert log.unrecorded_frees == 1
    assert upstream.stats().live_allocations == 0
    assert as_tuples(open_trace(path).events()) == [(ALLOC, 0, late, 2 * MiB), (FREE, 0, late, 2 * MiB)]


def test_after_close(upstream, tmp_path):
    log = vmalloc.LoggingAllocator(upstream, tmp_path / "t.vmtrace")
    a = log.allocate(MiB)
    log.close()
    log.close()  # idempotent
    with pytest.raises(vmalloc.VmallocError, match="is closed"):
        log.allocate(MiB)
    log.deallocate(a)  # memory can always be given back
    assert upstream.stats().live_allocations == 0
    assert log.events_written == 1


def test_flush_makes_records_readable_while_open(upstream, tmp_path):
    path = tmp_path / "t.vmtrace"
    log = vmalloc.LoggingAllocator(upstream, path)
    a = log.allocate(MiB)
    log.flush()
    # The count is written on close; until then readers take the file to its end.
    trace = open_trace(path)
    assert trace.info.events is None
    assert as_tuples(trace.events()) == [(ALLOC, 0, a, MiB)]
    log.deallocate(a)
    log.close()


def test_bad_arguments(upstream, tmp_path):
    with pytest.raises(vmalloc.InvalidArgumentError, match="cannot create trace file"):
        vmalloc.LoggingAllocator(upstream, tmp_path / "missing" / "t.vmtrace")
    with pytest.raises(TypeError):
        vmalloc.LoggingAllocator(object(), tmp_path / "t.vmtrace")


def test_wrapping_a_logging_allocator(upstream, tmp_path):
    inner = vmalloc.LoggingAllocator(upstream, tmp_path / "inner.vmtrace")
    outer = vmalloc.LoggingAllocator(inner, tmp_path / "outer.vmtrace")
    p = outer.allocate(4096)
    outer.deallocate(p)
    outer.close()
    inner.close()
    assert np.array_equal(open_trace(tmp_path / "inner.vmtrace").events(),
                          open_trace(tmp_path / "outer.vmtrace").events())


def test_threads_record_a_consistent_trace(upstream, tmp_path):
    path = tmp_path / "t.vmtrace"
    log = vmalloc.LoggingAllocator(upstream, path)
    per_thread = 300
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        live = []
        try:
            for _ in range(per_thread):
                if live and rng.random() < 0.5:
                    log.deallocate(live.pop(int(rng.integers(len(live)))))
                else:
                    live.append(log.allocate(int(rng.integers(1, 64 * 1024))))
            for p in live:
                log.deallocate(p)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert errors == []
    # Reading the trace through the normalizer finds nothing to fix: it is consistent.
    events = open_trace(path).events()
    live = {}
    for op, _, addr, size in as_tuples(events):
        if op == ALLOC:
            assert addr not in live
            live[addr] = size
        else:
            assert live.pop(addr) == size
    assert live == {}
    assert len(events) == log.events_written
    assert log.events_written >= 4 * per_thread


@settings(max_examples=30, deadline=None)
@given(
    script=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 3 * MiB)),
            st.tuples(st.just("free"), st.integers(0, 50)),
        ),
        max_size=40,
    )
)
def test_any_session_reads_back_exactly(tmp_path_factory, script):
    upstream = vmalloc.CachingAllocator(vmalloc.HostDevice(capacity="1GiB", backed=False))
    path = tmp_path_factory.mktemp("log") / "t.vmtrace"
    expected = []
    live = []
    with vmalloc.LoggingAllocator(upstream, path) as log:
        for action, value in script:
            if action == "alloc":
                p = log.allocate(value)
                live.append((p, value))
                expected.append((ALLOC, 0, p, value))
            elif live:
                p, size = live.pop(value % len(live))
                log.deallocate(p)
                expected.append((FREE, 0, p, size))
    assert as_tuples(open_trace(path).events()) == expected
    header = path.read_bytes()[:32]
    metadata_size = int.from_bytes(header[24:28], "little")
    assert os.path.getsize(path) == 32 + metadata_size + 32 * len(expected)
    assert int.from_bytes(header[16:24], "little") == len(expected)
