"""CachingAllocator: PyTorch's best-fit caching policy, rule by rule, with exact values.

The generic allocator protocol (data integrity, bad inputs, threads) is tested for every
allocator in tests/alloc/test_allocator_protocol.py; this file tests what is particular to the
caching policy. Most tests run on an unbacked HostDevice (accounting only), so sizes are free.
"""

import bisect
import pickle
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc

KiB = 1 << 10
MiB = 1 << 20

pytestmark = pytest.mark.skipif(not hasattr(vmalloc, "HostDevice"),
                                reason="vmalloc.HostDevice is not built")

SEGMENT_CALLS = ("create", "reserve", "map", "set_access", "unmap", "free_address", "release")


def make(capacity=None, backed=False, granularity="2MiB", **options):
    device = vmalloc.HostDevice(capacity=capacity, granularity=granularity, backed=backed)
    return device, vmalloc.CachingAllocator(device, **options)


def layout(ca):
    """[(pool, segment size, [(block size, state), ...]), ...] in address order."""
    return [(s["pool"], s["size"], [(b["size"], b["state"]) for b in s["blocks"]])
            for s in ca.snapshot()]


def calls(device, names=SEGMENT_CALLS):
    c = device.counters()
    return [c[n] for n in names]


# ---- rounding, pools and segment sizes ----

@pytest.mark.parametrize("nbytes, block", [
    (1, 512), (511, 512), (512, 512), (513, 1024), (MiB - 1, MiB), (MiB, MiB),
    (MiB + 1, MiB + 512), (10 * MiB + 1, 10 * MiB + 512)])
def test_requests_round_up_to_512_bytes(nbytes, block):
    _, ca = make()
    assert ca.round_size(nbytes) == block
    ca.allocate(nbytes)
    s = ca.stats()
    assert (s.requested_bytes, s.allocated_bytes) == (nbytes, block)
    assert s.internal_fragmentation_bytes == block - nbytes


@pytest.mark.parametrize("nbytes, pool, segment", [
    (1, "small", 2 * MiB),
    (MiB, "small", 2 * MiB),                 # kSmallSize is still small
    (MiB + 1, "large", 20 * MiB),            # 1 MiB < r < 10 MiB: kLargeBuffer
    (10 * MiB - 512, "large", 20 * MiB),
    (10 * MiB, "large", 10 * MiB),           # kMinLargeAlloc and up: round to 2 MiB
    (10 * MiB + 1, "large", 12 * MiB),
    (21 * MiB, "large", 22 * MiB),
    (100 * MiB + 3, "large", 102 * MiB)])
def test_pool_and_segment_size_of_a_miss(nbytes, pool, segment):
    _, ca = make()
    assert (ca.pool_of(nbytes), ca.segment_size(nbytes)) == (pool, segment)
    ca.allocate(nbytes)
    ((got_pool, got_size, _),) = layout(ca)
    assert (got_pool, got_size) == (pool, segment)
    assert ca.stats().reserved_bytes == segment


@pytest.mark.parametrize("nbytes, segment", [(1, 8 * MiB), (MiB + 1, 24 * MiB),
                                             (11 * MiB, 16 * MiB)])
def test_segments_round_up_to_a_larger_device_granularity(nbytes, segment):
    _, ca = make(granularity="8MiB")
    ca.allocate(nbytes)
    assert ca.stats().reserved_bytes == segment


def test_small_requests_pack_into_2mib_segments():
    _, ca = make()
    ptrs = [ca.allocate(512 * KiB) for _ in range(4)]
    base = ca.snapshot()[0]["address"]
    assert ptrs == [base + i * 512 * KiB for i in range(4)]
    assert ca.stats().reserved_bytes == 2 * MiB
    ca.allocate(1)
    assert ca.stats().reserved_bytes == 4 * MiB


def test_mid_size_requests_pack_into_20mib_segments():
    _, ca = make()
    for _ in range(5):
        ca.allocate(4 * MiB)
    assert layout(ca) == [("large", 20 * MiB, [(4 * MiB, "allocated")] * 5)]
    ca.allocate(4 * MiB)
    assert ca.stats().reserved_bytes == 40 * MiB


def test_a_segment_costs_four_driver_calls_to_make_and_three_to_free():
    device, ca = make()
    p = ca.allocate(100)
    assert calls(device) == [1, 1, 1, 1, 0, 0, 0]
    q = ca.allocate(100)              # carved from the cached segment: no call
    ca.deallocate(p)
    ca.deallocate(q)
    assert calls(device) == [1, 1, 1, 1, 0, 0, 0]
    assert ca.release_cached() == 2 * MiB
    assert calls(device) == [1, 1, 1, 1, 1, 1, 1]
    assert device.counters()["synchronize"] == 1   # cudaFree's implicit synchronization


# ---- best fit ----

def test_best_fit_takes_the_smallest_cached_block_that_fits():
    _, ca = make()
    ptrs = {size: ca.allocate(size) for size in (16 * MiB, 12 * MiB, 14 * MiB)}
    for p in ptrs.values():
        ca.deallocate(p)
    assert ca.allocate(13 * MiB) == ptrs[14 * MiB]
    s = ca.stats()
    # 1 MiB would remain: not more than kSmallSize, so the block is not split.
    assert (s.allocated_bytes, s.reserved_bytes) == (14 * MiB, 42 * MiB)
    assert s.internal_fragmentation_bytes == MiB


def test_equal_sizes_are_taken_lowest_address_first():
    _, ca = make()
    a, b = ca.allocate(12 * MiB), ca.allocate(12 * MiB)
    ca.deallocate(b)
    ca.deallocate(a)
    assert ca.allocate(12 * MiB) == min(a, b)
    assert ca.allocate(12 * MiB) == max(a, b)


def test_cached_blocks_serve_only_their_allocation_stream():
    device, ca = make()
    s1 = device.create_stream()
    p = ca.allocate(12 * MiB)
    ca.deallocate(p)
    q = ca.allocate(12 * MiB, stream=s1)
    assert q != p
    assert ca.stats().reserved_bytes == 24 * MiB
    assert ca.allocate(12 * MiB) == p


# ---- split and merge ----

@pytest.mark.parametrize("nbytes, blocks", [
    (19 * MiB - 512, [(19 * MiB - 512, "allocated"), (MiB + 512, "free")]),
    (19 * MiB, [(20 * MiB, "allocated")]),           # exactly 1 MiB would remain
    (12 * MiB, [(12 * MiB, "allocated"), (8 * MiB, "free")])])
def test_large_blocks_split_only_when_more_than_1mib_remains(nbytes, blocks):
    _, ca = make()
    ca.deallocate(ca.allocate(2 * MiB))  # leaves one free, unsplit 20 MiB segment
    ca.allocate(nbytes)
    assert layout(ca) == [("large", 20 * MiB, blocks)]


def test_small_blocks_split_when_512_bytes_remain():
    _, ca = make()
    ca.allocate(MiB)
    ca.allocate(MiB - 512)
    ca.allocate(512)
    assert layout(ca) == [("small", 2 * MiB, [(MiB, "allocated"), (MiB - 512, "allocated"),
                                              (512, "allocated")])]


def test_freed_blocks_merge_with_free_neighbours_of_their_segment():
    _, ca = make()
    a, b, c = (ca.allocate(512 * KiB) for _ in range(3))
    ca.deallocate(a)
    ca.deallocate(c)
    assert layout(ca) == [("small", 2 * MiB, [(512 * KiB, "free"), (512 * KiB, "allocated"),
                                              (MiB, "free")])]
    ca.deallocate(b)
    assert layout(ca) == [("small", 2 * MiB, [(2 * MiB, "free")])]
    assert ca.segment_stats()["unsplit_free_segments"] == 1
    assert ca.release_cached() == 2 * MiB
    assert layout(ca) == []


def test_blocks_of_different_segments_never_merge():
    _, ca = make()
    a, b = ca.allocate(10 * MiB), ca.allocate(10 * MiB)
    ca.deallocate(a)
    ca.deallocate(b)
    assert [blocks for _, _, blocks in layout(ca)] == [[(10 * MiB, "free")]] * 2
    assert ca.segment_stats()["largest_free_block"] == 10 * MiB


# ---- max_split_size ----

def test_requests_below_max_split_size_never_take_oversize_blocks():
    _, ca = make(max_split_size="32MiB")
    p = ca.allocate(40 * MiB)
    ca.deallocate(p)
    q = ca.allocate(12 * MiB)
    assert q != p
    assert ca.stats().reserved_bytes == 52 * MiB
    # A request of at least max_split_size takes it: 40 MiB < 38 MiB + 20 MiB.
    assert ca.allocate(38 * MiB) == p
    assert ca.stats().allocated_bytes == 12 * MiB + 40 * MiB   # oversize: never split


def test_oversize_blocks_are_taken_only_within_max_non_split_rounding_size():
    _, ca = make(max_split_size="32MiB")
    p = ca.allocate(60 * MiB)
    ca.deallocate(p)
    assert ca.allocate(36 * MiB) != p        # 60 MiB >= 36 MiB + 20 MiB
    assert ca.allocate(41 * MiB) == p        # 60 MiB < 41 MiB + 20 MiB
    _, wide = make(max_split_size="32MiB", max_non_split_rounding_size="30MiB")
    p = wide.allocate(60 * MiB)
    wide.deallocate(p)
    assert wide.allocate(36 * MiB) == p      # 60 MiB < 36 MiB + 30 MiB


def test_without_max_split_size_large_cached_blocks_split():
    _, ca = make()
    ca.deallocate(ca.allocate(40 * MiB))
    ca.allocate(33 * MiB)
    assert layout(ca) == [("large", 40 * MiB, [(33 * MiB, "allocated"), (7 * MiB, "free")])]
    _, capped = make(max_split_size="32MiB")
    capped.deallocate(capped.allocate(40 * MiB))
    capped.allocate(33 * MiB)
    assert layout(capped) == [("large", 40 * MiB, [(40 * MiB, "allocated")])]


def test_max_split_size_of_20mib_is_accepted():
    _, ca = make(max_split_size="20MiB")
    assert ca.max_split_size == 20 * MiB
    assert ca.max_non_split_rounding_size == 20 * MiB
    assert (ca.policy, ca.budget) == ("pytorch", None)


@pytest.mark.parametrize("options, name", [
    ({"max_split_size": "19MiB"}, "max_split_size"),
    ({"max_split_size": 20 * MiB - 1}, "max_split_size"),
    ({"max_split_size": "lots"}, "max_split_size"),
    ({"max_non_split_rounding_size": "1MiB"}, "max_non_split_rounding_size"),
    ({"policy": "tensorflow"}, "policy"),
    ({"policy": 3}, "policy"),
    ({"policy": "cupy", "max_split_size": "64MiB"}, "max_split_size"),
    ({"policy": "nnabla", "max_non_split_rounding_size": "64MiB"}, "max_non_split_rounding_size"),
    ({"budget": 0}, "budget"),
    ({"budget": -1}, "budget")])
def test_bad_options_raise_invalid_argument_naming_the_option(options, name):
    device = vmalloc.HostDevice(backed=False)
    with pytest.raises(vmalloc.InvalidArgumentError, match=name):
        vmalloc.CachingAllocator(device, **options)


def test_device_is_required():
    with pytest.raises(TypeError):
        vmalloc.CachingAllocator(None)


# ---- out of memory ----

def test_oom_frees_every_unsplit_cached_segment_then_retries():
    device, ca = make(capacity="64MiB")
    a, b = ca.allocate(30 * MiB), ca.allocate(30 * MiB)
    ca.deallocate(a)
    ca.deallocate(b)
    ca.allocate(40 * MiB)
    assert ca.stats().reserved_bytes == 40 * MiB
    seg = ca.segment_stats()
    assert (seg["segments_created"], seg["segments_released"]) == (3, 2)
    assert (seg["alloc_retries"], seg["cache_flushes"]) == (1, 1)
    # The failed cuMemCreate is counted too: that is the driver traffic of the retry.
    assert calls(device) == [4, 3, 3, 3, 2, 2, 2]
    assert ca.stats().out_of_memory_count == 0


def test_oom_with_max_split_size_frees_one_oversize_block_first():
    _, ca = make(capacity="64MiB", max_split_size="20MiB")
    a, b = ca.allocate(30 * MiB), ca.allocate(30 * MiB)
    ca.deallocate(a)
    ca.deallocate(b)
    ca.allocate(12 * MiB)   # may not take a 30 MiB block; 72 MiB would not fit
    assert ca.stats().reserved_bytes == 42 * MiB
    seg = ca.segment_stats()
    assert (seg["segments_released"], seg["alloc_retries"], seg["cache_flushes"]) == (1, 0, 0)
    # The smallest large-enough block goes; equal sizes: the lowest address.
    assert [s["address"] for s in ca.snapshot() if s["size"] == 30 * MiB] == [max(a, b)]


def test_oom_frees_oversize_blocks_largest_first_until_enough():
    _, ca = make(capacity="96MiB", max_split_size="20MiB")
    ptrs = [ca.allocate(size) for size in (22 * MiB, 24 * MiB, 26 * MiB)]
    for p in ptrs:
        ca.deallocate(p)
    ca.allocate(30 * MiB)    # none cached is >= 30 MiB; 72 + 30 > 96
    # 26 MiB alone is not enough, 26 + 24 is; the 22 MiB block stays.
    assert sorted(s["size"] for s in ca.snapshot()) == [22 * MiB, 30 * MiB]
    assert ca.segment_stats()["alloc_retries"] == 0


def test_oom_raises_after_flushing_the_cache_and_keeps_the_rest_intact():
    device, ca = make(capacity="64MiB", backed=True)
    live = ca.allocate(40 * MiB)
    pattern = bytes(range(256)) * 16
    device.write(live, pattern)
    device.write(live + 40 * MiB - len(pattern), pattern)
    ca.deallocate(ca.allocate(12 * MiB))   # a cached, unsplit 12 MiB segment
    small = ca.allocate(100)               # a split small segment: cannot be freed
    before = ca.stats()
    with pytest.raises(vmalloc.OutOfMemoryError) as raised:
        ca.allocate(30 * MiB)
    after = ca.stats()
    error = raised.value
    assert error.requested_bytes == 30 * MiB
    assert error.stats == after
    assert "30.00 MiB" in str(error) and "host:0" in str(error)
    # Like PyTorch, the failed attempt leaves the cache flushed; nothing else changes.
    assert after.reserved_bytes == before.reserved_bytes - 12 * MiB
    assert after.cached_bytes == before.cached_bytes - 12 * MiB
    assert after.out_of_memory_count == 1
    unchanged = ("requested_bytes", "allocated_bytes", "live_allocations", "total_allocations",
                 "total_deallocations", "peak_reserved_bytes", "internal_fragmentation_bytes")
    assert [getattr(after, f) for f in unchanged] == [getattr(before, f) for f in unchanged]
    assert sorted(size for _, size, _ in layout(ca)) == [2 * MiB, 40 * MiB]
    assert ca.allocation_size(small) == 100
    assert device.read(live, len(pattern)) == pattern
    assert device.read(live + 40 * MiB - len(pattern), len(pattern)) == pattern
    ca.deallocate(live)
    assert ca.allocate(30 * MiB) != 0     # recovers once memory is freed


def test_budget_limits_reserved_bytes():
    _, ca = make(budget="24MiB")
    assert ca.budget == 24 * MiB
    ca.allocate(2 * MiB)     # a 20 MiB segment
    ca.allocate(1)           # a 2 MiB small segment: 22 MiB
    ca.allocate(10 * MiB)    # from the 18 MiB left in the 20 MiB segment
    with pytest.raises(vmalloc.OutOfMemoryError, match="budget"):
        ca.allocate(10 * MiB)    # a new segment would take 42 MiB
    assert ca.stats().reserved_bytes == 22 * MiB


# ---- the fragmentation the paper removes ----

def test_interleaved_sizes_leave_reserved_well_above_requested():
    _, ca = make()
    fours = [ca.allocate(4 * MiB) for _ in range(10)]   # two 20 MiB segments
    for p in fours[::2]:
        ca.deallocate(p)                                 # 20 MiB free, in 4 MiB holes
    for _ in range(5):
        ca.allocate(6 * MiB)                             # fits no hole: two more segments
    s = ca.stats()
    assert (s.requested_bytes, s.reserved_bytes, s.cached_bytes) == (50 * MiB, 80 * MiB, 30 * MiB)
    assert s.utilization == 50 / 80
    assert ca.release_cached() == 0                      # every segment holds a live block
    seg = ca.segment_stats()
    assert (seg["free_blocks"], seg["free_bytes"], seg["largest_free_block"]) == \
        (7, 30 * MiB, 8 * MiB)


def test_fragmentation_runs_out_of_memory_with_enough_bytes_free():
    _, ca = make(capacity="40MiB")
    fours = [ca.allocate(4 * MiB) for _ in range(10)]
    for p in fours[::2]:
        ca.deallocate(p)
    with pytest.raises(vmalloc.OutOfMemoryError):
        ca.allocate(6 * MiB)
    assert ca.stats().cached_bytes == 20 * MiB


# ---- against PyTorch itself ----

SNAPSHOT = (Path(__file__).resolve().parents[3] / "shared" / "traces" /
            "torch_snapshot_transformer_lm.pickle")


@pytest.mark.skipif(not SNAPSHOT.exists(), reason="shared/traces is not beside the repository")
def test_pytorch_placed_every_traced_allocation_in_the_pool_this_policy_predicts():
    with open(SNAPSHOT, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["allocator_settings"]["max_split_size"] == -1   # PyTorch's defaults
    segments = sorted((s["address"], s["total_size"], s["segment_type"])
                      for s in snapshot["segments"])
    starts = [address for address, _, _ in segments]
    _, ca = make()
    # Every segment PyTorch made has a size this policy makes.
    for _, size, pool in segments:
        assert valid_segment(pool, size), (pool, size)
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) == 2162
    for e in allocs:
        address, size, pool = segments[bisect.bisect_right(starts, e["addr"]) - 1]
        assert pool == ca.pool_of(e["size"]), e["size"]
        assert e["addr"] % 512 == 0
        assert e["addr"] + ca.round_size(e["size"]) <= address + size


# ---- streams ----

def test_free_on_the_allocation_stream_is_reusable_at_once():
    device, ca = make()
    s1 = device.create_stream()
    p = ca.allocate(12 * MiB, stream=s1)
    ca.deallocate(p, stream=s1)
    assert ca.allocate(12 * MiB, stream=s1) == p
    assert device.counters()["event_record"] == 0


def test_free_on_another_stream_waits_for_an_event():
    device, ca = make()
    s1 = device.create_stream()
    p = ca.allocate(12 * MiB)
    ca.deallocate(p, stream=s1)
    assert layout(ca) == [("large", 12 * MiB, [(12 * MiB, "waiting")])]
    seg = ca.segment_stats()
    assert (seg["waiting_blocks"], seg["waiting_bytes"], seg["free_blocks"]) == (1, 12 * MiB, 0)
    s = ca.stats()
    assert (s.allocated_bytes, s.cached_bytes, s.live_allocations) == (0, 12 * MiB, 0)
    device.synchronize_stream(s1)
    # The next allocate finds the event complete; the block is back in stream 0's pool.
    assert ca.allocate(12 * MiB) == p
    c = device.counters()
    assert (c["event_create"], c["event_record"]) == (1, 1)


def test_a_block_waits_while_the_freeing_stream_is_busy():
    device, ca = make()
    if not hasattr(device, "hold_stream"):
        pytest.skip("HostDevice.hold_stream is not built")
    s1 = device.create_stream()
    p = ca.allocate(12 * MiB)
    hold = device.hold_stream(s1)       # s1 busy: the event recorded at free time is pending
    try:
        ca.deallocate(p, stream=s1)
        q = ca.allocate(12 * MiB)
        assert q != p                    # not reused while s1's earlier work may use it
        assert ca.segment_stats()["waiting_blocks"] == 1
        assert ca.stats().reserved_bytes == 24 * MiB
    finally:
        device.release_hold(hold)
    device.synchronize_stream(s1)
    assert ca.allocate(12 * MiB) == p
    assert ca.segment_stats()["waiting_blocks"] == 0


def test_a_block_freed_on_another_stream_returns_to_its_allocation_stream():
    device, ca = make()
    s1 = device.create_stream()
    p = ca.allocate(12 * MiB)
    ca.deallocate(p, stream=s1)
    device.synchronize()
    assert ca.allocate(12 * MiB, stream=s1) != p
    assert ca.allocate(12 * MiB) == p


def test_events_come_from_a_pool():
    device, ca = make()
    s1 = device.create_stream()
    for _ in range(5):
        ca.deallocate(ca.allocate(12 * MiB), stream=s1)
        device.synchronize_stream(s1)
    c = device.counters()
    assert (c["event_create"], c["event_record"]) == (1, 5)
    assert ca.stats().reserved_bytes == 12 * MiB


def test_release_cached_waits_for_pending_frees():
    device, ca = make()
    s1 = device.create_stream()
    ca.deallocate(ca.allocate(12 * MiB), stream=s1)
    assert ca.release_cached() == 12 * MiB
    assert device.counters()["event_synchronize"] == 1
    assert ca.stats().reserved_bytes == 0


def test_record_stream_delays_reuse_until_that_stream_catches_up():
    device, ca = make()
    s1, s2 = device.create_stream(), device.create_stream()
    p = ca.allocate(12 * MiB)
    ca.record_stream(p, s1)
    ca.record_stream(p, s2)
    ca.record_stream(p, 0)      # the allocation stream itself needs no event
    assert device.counters()["event_record"] == 2   # each new stream checked once
    ca.record_stream(p, s1)     # already recorded: no call
    ca.deallocate(p)            # freed on the allocation stream, used by s1 and s2
    assert layout(ca)[0][2] == [(12 * MiB, "waiting")]
    assert device.counters()["event_record"] == 4
    device.synchronize()
    assert ca.allocate(12 * MiB) == p
    with pytest.raises(vmalloc.InvalidPointerError):
        ca.record_stream(p + 512, s1)
    with pytest.raises(vmalloc.DeviceError):
        ca.record_stream(p, 987654321)    # refused now, so the free below still works
    ca.deallocate(p)
    assert ca.stats().live_allocations == 0


def test_reuse_never_overtakes_work_queued_on_the_freeing_stream():
    device, ca = make(backed=True)
    s1 = device.create_stream()
    size = 8 * MiB
    source = ca.allocate(size)
    device.write(source, b"A" * size)
    block = ca.allocate(size)
    for _ in range(5):
        device.copy_device(block, source, size, stream=s1)   # queued on s1
        ca.deallocate(block, stream=s1)
        block = ca.allocate(size)                            # stream 0
        device.write(block, b"B" * 4096)
        device.write(block + size - 4096, b"B" * 4096)
        device.synchronize()
        # Had the block been reused before s1's copy ran, the copy would have overwritten B.
        assert device.read(block, 4096) == b"B" * 4096
        assert device.read(block + size - 4096, 4096) == b"B" * 4096


def test_freeing_on_an_unknown_stream_changes_nothing():
    device, ca = make()
    p = ca.allocate(100)
    before = ca.stats()
    with pytest.raises(vmalloc.DeviceError):
        ca.deallocate(p, stream=987654321)
    assert ca.stats() == before
    assert ca.allocation_size(p) == 100


# ---- errors particular to the caching allocator's messages ----

def test_pointer_errors_say_what_the_pointer_is():
    _, ca = make()
    p = ca.allocate(4096)
    q = ca.allocate(4096)
    ca.deallocate(q)
    before = ca.stats()
    with pytest.raises(vmalloc.InvalidPointerError, match="interior pointer, 512 bytes into"):
        ca.deallocate(p + 512)
    with pytest.raises(vmalloc.InvalidPointerError, match="already freed"):
        ca.deallocate(q)
    with pytest.raises(vmalloc.InvalidPointerError, match="never allocated"):
        ca.deallocate(12345)
    with pytest.raises(vmalloc.InvalidArgumentError, match="nbytes 4095 does not match"):
        ca.deallocate(p, 4095)
    assert ca.stats() == before


def test_zero_bytes_and_absurd_sizes():
    device, ca = make()
    assert ca.allocate(0) == 0
    ca.deallocate(0)
    assert ca.stats() == vmalloc.Stats()
    with pytest.raises(vmalloc.InvalidArgumentError):
        ca.allocate(1 << 57)
    assert device.counters()["memory_management_calls"] == 0


# ---- presets ----

def test_nnabla_preset():
    device, ca = make(granularity="64KiB", policy="nnabla")
    assert ca.policy == "nnabla"
    assert [ca.round_size(n) for n in (1, MiB - 1, MiB, MiB + 1)] == \
        [512, MiB, MiB, MiB + 128 * KiB]
    ca.allocate(100)                       # small miss: a 1 MiB segment
    p = ca.allocate(3 * MiB + 1)           # large miss: the exact rounded size
    assert [(pool, size) for pool, size, _ in layout(ca)] in (
        [("small", MiB), ("large", 3 * MiB + 128 * KiB)],
        [("large", 3 * MiB + 128 * KiB), ("small", MiB)])
    ca.deallocate(p)
    # Not stream-aware: another stream takes the cached block.
    assert ca.allocate(3 * MiB, stream=device.create_stream()) == p


def test_cupy_preset():
    _, ca = make(granularity="64KiB", policy="cupy")
    assert ca.pool_of(1) == ca.pool_of(100 * MiB) == "large"   # one pool
    p = ca.allocate(1)
    q = ca.allocate(1000)
    assert q == p + 512                    # every remainder is split off
    assert layout(ca) == [("large", 64 * KiB, [(512, "allocated"), (1024, "allocated"),
                                               (63 * KiB - 512, "free")])]
    ca.allocate(5 * MiB)                   # a miss allocates the exact rounded size
    assert ca.stats().reserved_bytes == 64 * KiB + 5 * MiB


# ---- properties ----

def valid_segment(pool, size):
    if pool == "small":
        return size == 2 * MiB
    return size == 20 * MiB or (size >= 10 * MiB and size % (2 * MiB) == 0)


def check_invariants(device, ca, live):
    s = ca.stats()
    segments = ca.snapshot()
    assert s.requested_bytes == sum(live.values())
    assert s.live_allocations == len(live)
    assert s.internal_fragmentation_bytes == s.allocated_bytes - s.requested_bytes
    assert s.cached_bytes == s.reserved_bytes - s.allocated_bytes
    assert s.reserved_bytes == sum(seg["size"] for seg in segments) == \
        device.physical_bytes_in_use
    for f in ("requested", "reserved", "allocated", "internal_fragmentation"):
        assert getattr(s, f"peak_{f}_bytes") >= getattr(s, f"{f}_bytes")
    allocated = 0
    for seg in segments:
        assert valid_segment(seg["pool"], seg["size"])
        address = seg["address"]
        previous = None
        for b in seg["blocks"]:
            assert b["address"] == address and b["size"] % 512 == 0
            address += b["size"]
            if b["state"] == "allocated":
                assert live[b["address"]] == b["requested"] <= b["size"]
                assert b["size"] >= ca.round_size(b["requested"])
                allocated += b["size"]
            assert not (previous == "free" and b["state"] == "free"), "unmerged neighbours"
            previous = b["state"]
        assert address == seg["address"] + seg["size"]
    assert allocated == s.allocated_bytes


sizes = st.one_of(st.integers(1, MiB), st.integers(MiB + 1, 10 * MiB),
                  st.integers(10 * MiB, 48 * MiB))
operations = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "free", "release",
                                                 "sync"]),
                                 sizes, st.integers(0, 2), st.integers(0, 10**6)),
                      max_size=50)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, max_split=st.sampled_from([None, "20MiB", "32MiB"]))
def test_stats_identities_and_segment_sizes_always_hold(ops, max_split):
    device, ca = make(capacity="192MiB", max_split_size=max_split)
    streams = [0, device.create_stream(), device.create_stream()]
    live = {}
    for op, size, stream, pick in ops:
        if op == "alloc":
            try:
                live[ca.allocate(size, stream=streams[stream])] = size
            except vmalloc.OutOfMemoryError:
                pass
        elif op == "free" and live:
            p = sorted(live)[pick % len(live)]
            ca.deallocate(p, live.pop(p), stream=streams[stream])
        elif op == "release":
            ca.release_cached()
        elif op == "sync":
            device.synchronize()
        check_invariants(device, ca, live)
    for p, size in live.items():
        ca.deallocate(p, size)
    ca.release_cached()
    assert ca.stats().reserved_bytes == 0 == device.physical_bytes_in_use


def test_threads_share_one_allocator():
    device, ca = make()
    errors = []

    def work(seed):
        try:
            mine = []
            for i in range(1500):
                if len(mine) > 40 or (mine and (i * seed) % 3 == 0):
                    p, n = mine.pop((i * 7) % len(mine))
                    ca.deallocate(p, n)
                else:
                    n = 1 + (i * seed * 7919) % (3 * MiB)
                    mine.append((ca.allocate(n), n))
            for p, n in mine:
                ca.deallocate(p, n)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = ca.stats()
    assert (s.requested_bytes, s.allocated_bytes, s.live_allocations) == (0, 0, 0)
    assert s.total_allocations == s.total_deallocations
    assert ca.release_cached() == s.reserved_bytes
    assert device.physical_bytes_in_use == 0
