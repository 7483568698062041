"""Out-of-host-memory and failing-writer paths of the LoggingAllocator: an allocation that
succeeded upstream is never lost when recording it fails."""

import pytest

import vmalloc

MiB = 1 << 20


@pytest.mark.parametrize("kind", ["virtual", "caching", "packed"])
def test_logging_allocator_with_a_failing_writer_loses_nothing(kind):
    dev = vmalloc.HostDevice(capacity="256MiB")
    if kind == "caching":
        upstream = vmalloc.CachingAllocator(dev)
    else:
        upstream = vmalloc.VirtualAllocator(
            dev, placement="packed" if kind == "packed" else "chunks")
    log = vmalloc.LoggingAllocator(upstream, "/dev/full")  # every write fails (ENOSPC)
    ptrs = [log.allocate(n) for n in [1000, 300, 512, 5000] * 2000]  # > one write buffer
    assert upstream.stats().live_allocations == len(ptrs)
    for p in ptrs:
        log.deallocate(p)
    assert upstream.stats().live_allocations == 0
    assert log.failed_allocations == 0
    with pytest.raises(vmalloc.VmallocError, match="stopped recording"):
        log.flush()
    with pytest.raises(vmalloc.VmallocError):
        log.close()
    p = log.upstream.allocate(MiB)  # the upstream is intact
    log.upstream.deallocate(p)
