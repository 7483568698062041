"""PhysicalChunkPool: fixed-size chunks, their cache, the budget and the statistics."""

import pytest

import vmalloc

pytestmark = pytest.mark.skipif(
    not hasattr(vmalloc, "HostDevice") or not hasattr(vmalloc, "VirtualAllocator"),
    reason="vmalloc.HostDevice / VirtualAllocator not built")

MiB = 1 << 20


def pool_class():
    # The public path (docs/api.rst documents the class there, issue 22 item 7).
    return vmalloc.PhysicalChunkPool


def test_the_pool_is_public_at_the_package_root():
    from vmalloc._core.physical_chunk_pool import PhysicalChunkPool

    assert vmalloc.PhysicalChunkPool is PhysicalChunkPool
    assert "PhysicalChunkPool" in vmalloc.__all__


def test_chunk_size_must_be_a_positive_multiple_of_the_granularity():
    dev = vmalloc.HostDevice(granularity="2MiB", backed=False)
    Pool = pool_class()
    for bad in (0, MiB, 3 * MiB, 2 * MiB + 512):
        with pytest.raises(vmalloc.InvalidArgumentError, match="chunk_size"):
            Pool(dev, bad)
    assert Pool(dev, 4 * MiB).stats()["chunk_size"] == 4 * MiB


def test_budget_below_one_chunk_is_rejected():
    dev = vmalloc.HostDevice(backed=False)
    with pytest.raises(vmalloc.InvalidArgumentError, match="budget"):
        pool_class()(dev, "2MiB", budget=MiB)
    with pytest.raises(vmalloc.InvalidArgumentError, match="budget"):
        pool_class()(dev, "2MiB", budget=0)


def test_acquire_creates_then_reuses_the_cache():
    dev = vmalloc.HostDevice(backed=False)
    pool = pool_class()(dev, "2MiB")
    a, b = pool.acquire(), pool.acquire()
    assert a != b
    assert dev.counters()["create"] == 2
    pool.give_back(a)
    assert pool.stats() == {"chunk_size": 2 * MiB, "budget_bytes": 0, "chunks_held": 2,
                            "peak_chunks_held": 2, "chunks_cached": 1, "chunks_created": 2,
                            "chunks_released": 0}
    assert pool.acquire() == a  # from the cache: no new cuMemCreate
    assert dev.counters()["create"] == 2
    assert pool.take_cached() == 0  # cache empty: take_cached never creates
    assert dev.counters()["create"] == 2


def test_budget_limits_chunks_held():
    dev = vmalloc.HostDevice(backed=False)
    pool = pool_class()(dev, "2MiB", budget="5MiB")  # two whole chunks
    assert pool.creatable_chunks() == 2
    held = [pool.acquire(), pool.acquire()]
    assert pool.creatable_chunks() == 0
    with pytest.raises(vmalloc.OutOfMemoryError, match="budget"):
        pool.acquire()
    assert pool.stats()["chunks_held"] == 2
    assert dev.counters()["create"] == 2  # the budget refused before the device was asked
    pool.give_back(held[0])
    assert pool.acquire() == held[0]


def test_device_capacity_out_of_memory_changes_nothing():
    dev = vmalloc.HostDevice(capacity="6MiB", backed=False)
    pool = pool_class()(dev, "2MiB")
    assert pool.creatable_chunks() == 3
    chunks = [pool.acquire() for _ in range(3)]
    before = pool.stats()
    with pytest.raises(vmalloc.OutOfMemoryError):
        pool.create()
    assert pool.stats() == before
    pool.release(chunks[0])
    assert pool.stats()["chunks_held"] == 2
    assert pool.stats()["chunks_released"] == 1
    assert dev.physical_bytes_in_use == 4 * MiB


def test_release_cached_returns_exact_bytes():
    dev = vmalloc.HostDevice(backed=False)
    pool = pool_class()(dev, "4MiB")
    chunks = [pool.acquire() for _ in range(5)]
    for c in chunks[:3]:
        pool.give_back(c)
    assert pool.release_cached() == 3 * 4 * MiB
    assert pool.release_cached() == 0
    assert dev.physical_bytes_in_use == 2 * 4 * MiB
    s = pool.stats()
    assert (s["chunks_held"], s["chunks_cached"], s["chunks_released"], s["peak_chunks_held"]) == (
        2, 0, 3, 5)


def test_give_back_of_a_foreign_or_cached_chunk_is_rejected():
    dev = vmalloc.HostDevice(backed=False)
    pool = pool_class()(dev, "2MiB")
    c = pool.acquire()
    pool.give_back(c)
    before = pool.stats()
    with pytest.raises(vmalloc.InvalidArgumentError, match="not a chunk of this pool"):
        pool.give_back(c)  # already cached
    foreign = dev.create(2 * MiB)
    with pytest.raises(vmalloc.InvalidArgumentError, match="not a chunk of this pool"):
        pool.give_back(foreign)
    with pytest.raises(vmalloc.InvalidArgumentError):
        pool.release(foreign)
    assert pool.stats() == before
    dev.release(foreign)


def test_destruction_releases_every_chunk():
    dev = vmalloc.HostDevice(backed=False)
    pool = pool_class()(dev, "2MiB")
    held = pool.acquire()
    pool.give_back(pool.acquire())
    assert held and dev.physical_bytes_in_use == 4 * MiB
    del pool
    assert dev.physical_bytes_in_use == 0


def test_a_chunk_maps_anywhere_and_keeps_its_bytes():
    """Any chunk backs any chunk-sized slot: the bytes follow the chunk to its new address."""
    dev = vmalloc.HostDevice(capacity="8MiB")
    pool = pool_class()(dev, "2MiB")
    chunk = pool.acquire()
    a = dev.reserve(2 * MiB, 2 * MiB)
    dev.map(a, 2 * MiB, chunk)
    dev.set_access(a, 2 * MiB)
    dev.write(a, b"chunk bytes")
    dev.unmap(a, 2 * MiB)
    pool.give_back(chunk)
    b = dev.reserve(4 * MiB, 2 * MiB)
    again = pool.acquire()
    assert again == chunk
    dev.map(b + 2 * MiB, 2 * MiB, again)
    dev.set_access(b + 2 * MiB, 2 * MiB)
    assert dev.read(b + 2 * MiB, 11) == b"chunk bytes"
    dev.unmap(b + 2 * MiB, 2 * MiB)
    dev.free_address(a, 2 * MiB)
    dev.free_address(b, 4 * MiB)


def test_virtual_allocator_reports_the_pool():
    dev = vmalloc.HostDevice(capacity="32MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev, budget="16MiB")
    assert va.budget == 16 * MiB
    p = va.allocate(5 * MiB)
    cs = va.chunk_stats()
    assert (cs["chunks_held"], cs["chunks_created"], cs["budget_bytes"]) == (3, 3, 16 * MiB)
    va.deallocate(p)
    assert va.release_cached() == 6 * MiB
    cs = va.chunk_stats()
    assert (cs["chunks_held"], cs["chunks_released"], cs["peak_chunks_held"]) == (0, 3, 3)
