"""PyTorch's expandable segments (CachingAllocator(expandable_segments=True)), checked against
sequences worked out by hand from c10/cuda/CUDACachingAllocator.cpp: which pages are mapped
and unmapped, the exact driver calls, reserved bytes and block layout."""

import pytest

import vmalloc

MiB = 1 << 20
CALLS = ("create", "release", "reserve", "free_address", "map", "unmap", "set_access",
         "synchronize")


def calls(device):
    c = device.counters()
    return {k: c[k] for k in CALLS if c[k]}


@pytest.fixture
def dev():
    return vmalloc.HostDevice(capacity="1GiB", backed=False)


@pytest.fixture
def es(dev):
    return vmalloc.CachingAllocator(dev, expandable_segments=True)


def layout(allocator, base):
    """Each snapshot segment as (offset MiB, size MiB, [(offset, size, state), ...])."""
    return [((s["address"] - base) / MiB, s["size"] / MiB,
             [((b["address"] - base) / MiB, b["size"] / MiB, b["state"]) for b in s["blocks"]])
            for s in allocator.snapshot()]


def test_options_and_name(dev, es):
    assert es.expandable_segments is True
    assert es.name == "expandable-segments"
    assert vmalloc.CachingAllocator(dev).expandable_segments is False
    with pytest.raises(vmalloc.InvalidArgumentError, match="expandable_segments"):
        vmalloc.CachingAllocator(dev, policy="cupy", expandable_segments=True)


def test_grow_by_20MiB_pages_in_one_reserved_range(dev, es):
    a = es.allocate(3 * MiB)
    # One reservation of 9/8 of the device (1152 MiB, in whole 20 MiB pages: 1160 MiB), one
    # page created, mapped and opened.
    assert calls(dev) == {"create": 1, "reserve": 1, "map": 1, "set_access": 1}
    assert dev.state()["bytes_reserved"] == 1160 * MiB
    assert es.stats().reserved_bytes == 20 * MiB
    dev.reset_counters()
    # 30 MiB: the 17 MiB free at the end of the mapped range plus one more page.
    b = es.allocate(30 * MiB)
    assert calls(dev) == {"create": 1, "map": 1, "set_access": 1}
    assert b == a + 3 * MiB
    assert es.stats().reserved_bytes == 40 * MiB
    assert layout(es, a) == [(0, 40, [(0, 3, "allocated"), (3, 30, "allocated"),
                                      (33, 7, "free")])]
    # The fixed-segment caching allocator needs a second segment: 50 MiB.
    ca = vmalloc.CachingAllocator(dev)
    ca.allocate(3 * MiB)
    ca.allocate(30 * MiB)
    assert ca.stats().reserved_bytes == 50 * MiB


def test_one_request_maps_several_pages_with_one_set_access(dev, es):
    es.allocate(50 * MiB)
    assert calls(dev) == {"create": 3, "reserve": 1, "map": 3, "set_access": 1}
    assert es.stats().reserved_bytes == 60 * MiB


def test_shrink_unmaps_only_whole_free_pages(dev, es):
    a = es.allocate(3 * MiB)    # [0, 3)
    b = es.allocate(50 * MiB)   # [3, 53): maps pages 1 and 2
    c = es.allocate(6 * MiB)    # [53, 59): best fit in the 7 MiB tail
    assert (b - a, c - a) == (3 * MiB, 53 * MiB)
    assert es.stats().reserved_bytes == 60 * MiB
    es.deallocate(b)
    dev.reset_counters()
    # Free: [3, 53) and [59, 60). Only page 1 = [20, 40) lies wholly inside a free block.
    assert es.release_cached() == 20 * MiB
    assert calls(dev) == {"synchronize": 1, "unmap": 1, "release": 1}
    assert es.stats().reserved_bytes == 40 * MiB
    assert layout(es, a) == [
        (0, 20, [(0, 3, "allocated"), (3, 17, "free")]),
        (40, 20, [(40, 13, "free"), (53, 6, "allocated"), (59, 1, "free")]),
    ]
    # 30 MiB fits no free block (17, 13, 1): the hole is mapped again, and the free blocks on
    # both sides merge with it into one 50 MiB block.
    dev.reset_counters()
    d = es.allocate(30 * MiB)
    assert calls(dev) == {"create": 1, "map": 1, "set_access": 1}
    assert d == a + 3 * MiB
    assert es.stats().reserved_bytes == 60 * MiB
    assert layout(es, a) == [(0, 60, [(0, 3, "allocated"), (3, 30, "allocated"),
                                      (33, 20, "free"), (53, 6, "allocated"),
                                      (59, 1, "free")])]


def test_release_of_an_entirely_free_segment_frees_its_reservation(dev, es):
    a = es.allocate(3 * MiB)
    b = es.allocate(30 * MiB)
    es.deallocate(a)
    assert es.release_cached() == 0  # [0, 3) holds no whole page
    es.deallocate(b)
    dev.reset_counters()
    assert es.release_cached() == 40 * MiB
    assert calls(dev) == {"synchronize": 1, "unmap": 2, "release": 2, "free_address": 1}
    assert es.stats().reserved_bytes == 0
    assert es.snapshot() == []
    assert dev.state()["bytes_reserved"] == 0
    stats = es.segment_stats()
    assert (stats["segments_created"], stats["segments_released"]) == (2, 1)  # maps, unmaps


def test_small_pool_grows_by_2MiB_pages(dev, es):
    a = es.allocate(MiB)
    es.allocate(MiB)
    assert es.stats().reserved_bytes == 2 * MiB
    c = es.allocate(MiB)
    assert c == a + 2 * MiB  # the next page of the same range
    assert es.stats().reserved_bytes == 4 * MiB
    assert calls(dev) == {"create": 2, "reserve": 1, "map": 2, "set_access": 2}
    # The small pool's range: 1152 MiB in 2 MiB pages.
    assert dev.state()["bytes_reserved"] == 1152 * MiB
    assert [s["pool"] for s in es.snapshot()] == ["small"]


def test_one_range_per_stream_and_pool(dev, es):
    s = dev.create_stream()
    es.allocate(3 * MiB)
    es.allocate(3 * MiB, stream=s)
    es.allocate(512)
    es.allocate(512, stream=s)
    assert dev.counters()["reserve"] == 4
    assert es.stats().reserved_bytes == 2 * 20 * MiB + 2 * 2 * MiB


def test_best_fit_counts_a_tail_block_at_the_size_it_can_grow_to(dev, es):
    a = es.allocate(10 * MiB)   # [0, 10)
    es.allocate(5 * MiB)        # [10, 15); [15, 20) stays free, before unmapped space
    es.deallocate(a)
    # Free: [0, 10) (10 MiB) and the 5 MiB tail. Plain best fit takes the tail; PyTorch's
    # get_free_block counts the tail as 5 MiB + the unmapped rest and takes [0, 10).
    assert es.allocate(4 * MiB) == a


def test_large_blocks_split_down_to_512_bytes(dev, es):
    a = es.allocate(20 * MiB - 512)
    assert layout(es, a) == [(0, 20, [(0, 20 - 512 / MiB, "allocated"),
                                      (20 - 512 / MiB, 512 / MiB, "free")])]


def test_holes_between_live_blocks_stay_reserved():
    # The fragmentation example of docs/caching_allocator.rst: expandable segments do not
    # fill 4 MiB holes with 6 MiB requests either; they save only the per-segment rounding.
    for expandable, reserved in ((False, 80 * MiB), (True, 80 * MiB)):
        dev = vmalloc.HostDevice(capacity="1GiB", backed=False)
        al = vmalloc.CachingAllocator(dev, expandable_segments=expandable)
        ptrs = [al.allocate(4 * MiB) for _ in range(10)]
        for p in ptrs[::2]:
            al.deallocate(p)
        for _ in range(5):
            al.allocate(6 * MiB)
        assert al.stats().reserved_bytes == reserved
        assert al.release_cached() == 0


def test_out_of_memory_keeps_what_is_mapped():
    dev = vmalloc.HostDevice(capacity="100MiB", backed=False)
    es = vmalloc.CachingAllocator(dev, expandable_segments=True)
    es.allocate(90 * MiB)  # 5 pages: the whole device
    assert dev.state()["bytes_reserved"] == 120 * MiB  # 112.5 MiB in 20 MiB pages
    with pytest.raises(vmalloc.OutOfMemoryError):
        es.allocate(30 * MiB)
    assert es.stats().reserved_bytes == 100 * MiB
    assert dev.physical_bytes_in_use == 100 * MiB
    # A request larger than the whole reservation fails at once, without driver calls.
    dev.reset_counters()
    with pytest.raises(vmalloc.OutOfMemoryError):
        es.allocate(200 * MiB)
    assert dev.counters()["create"] == 0


def test_out_of_memory_path_unmaps_free_pages_and_retries():
    dev = vmalloc.HostDevice(capacity="60MiB", backed=False)
    es = vmalloc.CachingAllocator(dev, expandable_segments=True)
    s = dev.create_stream()
    a = es.allocate(40 * MiB)          # 2 pages on stream 0
    es.deallocate(a)                   # cached
    b = es.allocate(40 * MiB, stream=s)  # another stream's range: unmaps stream 0's pages
    assert es.stats().reserved_bytes == 40 * MiB
    assert es.segment_stats()["alloc_retries"] == 1
    es.deallocate(b, stream=s)


def test_budget_counts_the_fixed_segment_size(dev):
    es = vmalloc.CachingAllocator(dev, expandable_segments=True, budget="40MiB")
    es.allocate(3 * MiB)
    # PyTorch checks the fraction against get_allocation_size (20 MiB for < 10 MiB).
    es.allocate(17 * MiB)  # fits in the mapped page: no check
    with pytest.raises(vmalloc.OutOfMemoryError):
        es.allocate(30 * MiB)  # 20 MiB reserved + 30 MiB > 40 MiB


def test_replay_kind(dev):
    from vmalloc.replay import ALLOCATOR_KINDS, make_allocator

    assert ALLOCATOR_KINDS == ("caching", "expandable-segments", "virtual", "virtual-packed")
    al = make_allocator("expandable-segments", dev, max_split_size="64MiB", policy="nnabla")
    assert al.expandable_segments and al.policy == "pytorch" and al.max_split_size == 64 * MiB
