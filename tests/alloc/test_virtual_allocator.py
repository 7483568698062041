"""VirtualAllocator: chunks mapped into contiguous reservations, its cache, stealing, the
small-block arena, stream-ordered reuse and exact accounting."""

import ctypes
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc

pytestmark = pytest.mark.skipif(
    not hasattr(vmalloc, "HostDevice") or not hasattr(vmalloc, "VirtualAllocator"),
    reason="vmalloc.HostDevice / VirtualAllocator not built")

KiB = 1 << 10
MiB = 1 << 20
MC = 2 * MiB  # the default chunk size

MM_CALLS = ("create", "release", "reserve", "free_address", "map", "unmap", "set_access")


def chunks(n, mc=MC):
    return -(-n // mc)


def expected_allocated(n, va):
    """What the allocator must set aside for a request of n bytes."""
    if n <= va.small_threshold:
        return -(-n // 512) * 512
    return chunks(n, va.chunk_size) * va.chunk_size


def delta(before, after, names=MM_CALLS):
    return {k: after[k] - before[k] for k in names if after[k] != before[k]}


def check_identities(va, live=None):
    """The accounting identities; with `live` ({ptr: size}) also the exact sums."""
    s = va.stats()
    c = va.chunk_stats()
    mc = va.chunk_size
    assert s.internal_fragmentation_bytes == s.allocated_bytes - s.requested_bytes
    assert s.cached_bytes == s.reserved_bytes - s.allocated_bytes
    assert s.reserved_bytes == c["chunks_held"] * mc
    assert c["chunks_held"] == (c["chunks_live"] + c["chunks_cached"] + c["chunks_in_arenas"]
                                + c["chunks_in_pool"])
    assert c["free_chunks"] == c["chunks_cached"] + c["chunks_in_pool"] + c["arena_chunks_empty"]
    assert s.live_allocations == c["live_ranges"] + c["live_blocks"]
    assert s.requested_bytes <= s.allocated_bytes <= s.reserved_bytes
    assert s.peak_reserved_bytes >= s.reserved_bytes
    assert s.peak_allocated_bytes >= s.allocated_bytes
    assert s.peak_requested_bytes >= s.requested_bytes
    assert s.live_allocations == s.total_allocations - s.total_deallocations
    if live is not None:
        assert s.requested_bytes == sum(live.values())
        assert s.allocated_bytes == sum(expected_allocated(n, va) for n in live.values())
        assert s.live_allocations == len(live)
        large = [n for n in live.values() if n > va.small_threshold]
        assert c["chunks_live"] == sum(chunks(n, mc) for n in large)
    return s, c


# --- construction -------------------------------------------------------------------------

def test_defaults_follow_the_device_granularity():
    va = vmalloc.VirtualAllocator(vmalloc.HostDevice(backed=False))
    assert (va.chunk_size, va.small_threshold, va.budget, va.name) == (MC, MiB, None, "virtual")
    va = vmalloc.VirtualAllocator(vmalloc.HostDevice(granularity="64KiB", backed=False))
    assert va.chunk_size == MC
    va = vmalloc.VirtualAllocator(vmalloc.HostDevice(granularity="8MiB", backed=False))
    assert (va.chunk_size, va.small_threshold) == (8 * MiB, 4 * MiB)
    va = vmalloc.VirtualAllocator(vmalloc.HostDevice(backed=False), chunk_size="20MiB",
                                  small_threshold=0)
    assert (va.chunk_size, va.small_threshold) == (20 * MiB, 0)


@pytest.mark.parametrize("options, word", [
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": MiB}, "chunk_size"),
    ({"chunk_size": 3 * MiB}, "chunk_size"),
    ({"chunk_size": "2.5MiB"}, "chunk_size"),
    ({"budget": MiB}, "budget"),
    ({"budget": 0}, "budget"),
    ({"small_threshold": 3 * MiB}, "small_threshold"),
    ({"chunk_size": -2}, "chunk_size"),
])
def test_bad_options_are_rejected(options, word):
    dev = vmalloc.HostDevice(backed=False)
    with pytest.raises(vmalloc.InvalidArgumentError, match=word) as info:
        vmalloc.VirtualAllocator(dev, **options)
    assert type(info.value) is vmalloc.InvalidArgumentError
    assert dev.counters()["create"] == 0


# --- the chunk path: equation 1, contiguous mapping, cache ---------------------------------

def test_a_request_maps_k_chunks_into_one_contiguous_range():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    before = dev.counters()
    p = va.allocate(5 * MiB)
    # k = 3 chunks: one reservation, three chunks, three maps, ONE set_access over the run.
    assert delta(before, dev.counters()) == {"reserve": 1, "create": 3, "map": 3,
                                             "set_access": 1}
    assert p % MC == 0
    dev.write(p, b"a" * 16)
    dev.write(p + 5 * MiB - 16, b"z" * 16)  # crosses no gap: the range is contiguous
    dev.write(p + 2 * MiB - 8, b"0123456789abcdef")  # straddles a chunk boundary
    assert dev.read(p + 2 * MiB - 8, 16) == b"0123456789abcdef"
    s, c = check_identities(va, {p: 5 * MiB})
    assert (s.requested_bytes, s.allocated_bytes, s.reserved_bytes) == (5 * MiB, 6 * MiB, 6 * MiB)
    assert (c["reservations"], c["chunks_live"], c["live_ranges"]) == (1, 3, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9 * MC), min_size=1, max_size=25))
def test_equation_1_internal_fragmentation_below_one_chunk(sizes):
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    live = {}
    for n in sizes:
        before = va.stats()
        p = va.allocate(n)
        after = va.stats()
        grown = after.allocated_bytes - before.allocated_bytes
        assert grown == expected_allocated(n, va)
        if n > va.small_threshold:
            assert grown == chunks(n) * MC and grown - n < MC  # equation 1: IF < m_c
        else:
            assert grown - n < 512
        live[p] = n
        check_identities(va, live)
    for p in list(live)[::2]:
        va.deallocate(p, live.pop(p))
        check_identities(va, live)


def test_zero_bytes_returns_null_and_counts_nothing():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    before, calls = va.stats(), dev.counters()
    assert va.allocate(0) == 0
    va.deallocate(0)
    va.deallocate(0, 0)
    assert va.stats() == before
    assert dev.counters() == calls


def test_freed_range_is_reused_split_and_merged_without_driver_calls():
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    base = va.allocate(8 * MiB)  # 4 chunks
    va.deallocate(base, 8 * MiB)
    before = dev.counters()
    a = va.allocate(3 * MiB)  # 2 chunks: the front of the cached 4-chunk range
    b = va.allocate(4 * MiB)  # 2 chunks: the rest
    assert (a, b) == (base, base + 4 * MiB)
    assert va.chunk_stats()["cached_ranges"] == 0
    va.deallocate(a)
    va.deallocate(b)
    # Both halves merged back into one 4-chunk range, which serves a 4-chunk request.
    assert va.chunk_stats()["cached_ranges"] == 1
    assert va.allocate(7 * MiB) == base
    assert delta(before, dev.counters()) == {}
    check_identities(va)


def test_best_fit_by_chunk_count():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    ptrs = {k: va.allocate(k * MC) for k in (1, 3, 5, 8)}
    keep = va.allocate(MC)  # the ranges live in separate reservations anyway
    for p in ptrs.values():
        va.deallocate(p)
    before = dev.counters()
    assert va.allocate(2 * MC + 1) == ptrs[3]  # 3 is the smallest cached count >= 2
    assert va.allocate(4 * MC + 1) == ptrs[5]
    assert va.allocate(6 * MC) == ptrs[8]  # split: 2 chunks stay cached
    assert va.allocate(2 * MC) == ptrs[8] + 6 * MC  # the 2-chunk rest, an exact fit
    assert va.allocate(MC) == ptrs[1]
    assert delta(before, dev.counters()) == {}
    assert keep


def test_steady_state_training_loop_makes_no_driver_calls():
    dev = vmalloc.HostDevice(capacity="1GiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    rng = random.Random(7)
    layers = [rng.choice([3 * KiB, 40 * KiB, 700 * KiB, 3 * MiB, 9 * MiB, 17 * MiB])
              for _ in range(40)]
    params = [va.allocate(n) for n in layers]

    def step():
        acts = [va.allocate(n) for n in layers]  # forward: activations
        grads = []
        for n, a in zip(reversed(layers), reversed(acts)):  # backward
            tmp = va.allocate(n // 2 + 1)
            grads.append((va.allocate(n), n))
            va.deallocate(tmp)
            va.deallocate(a)
        for g, n in grads:  # optimizer
            va.deallocate(g, n)

    step()  # warm-up
    for _ in range(5):
        before = dev.counters()
        step()
        after = dev.counters()
        assert after["memory_management_calls"] - before["memory_management_calls"] == 0
        assert delta(before, after, ("event_create", "event_record", "event_query",
                                     "stream_wait_event")) == {}
    check_identities(va)
    assert params


# --- out of memory and the no-OOM guarantee ----------------------------------------------

def test_out_of_memory_is_exact_and_changes_nothing():
    dev = vmalloc.HostDevice(capacity="16MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    p = va.allocate(10 * MiB)  # 5 of 8 chunks
    small = va.allocate(100)  # an arena chunk: 6 of 8
    stats, calls, state = va.stats(), dev.counters(), dev.state()
    with pytest.raises(vmalloc.OutOfMemoryError) as info:
        va.allocate(5 * MiB)  # 3 chunks, 2 left
    e = info.value
    assert type(e) is vmalloc.OutOfMemoryError
    assert e.requested_bytes == 5 * MiB
    assert "5242880 bytes" in str(e) and "reserved=" in str(e)
    assert e.stats is not None and e.stats.out_of_memory_count == 1
    after = va.stats()
    assert after.out_of_memory_count == 1
    assert after.to_dict() | {"out_of_memory_count": 0} == stats.to_dict()
    assert dev.state() == state
    assert delta(calls, dev.counters()) == {}  # feasibility is decided before any call
    va.deallocate(small)
    va.deallocate(p)
    assert va.allocate(16 * MiB)  # every chunk, via stealing: recovered


def test_budget_is_a_limit_below_the_device_capacity():
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev, budget="8MiB")
    p = va.allocate(6 * MiB)
    with pytest.raises(vmalloc.OutOfMemoryError):
        va.allocate(4 * MiB)
    assert va.stats().reserved_bytes == 6 * MiB
    q = va.allocate(2 * MiB)
    va.deallocate(p)
    va.deallocate(q)
    assert va.allocate(8 * MiB)  # stolen from the two cached ranges
    assert va.chunk_stats()["chunks_created"] == 4


def test_stealing_remaps_cached_chunks_into_a_new_range():
    dev = vmalloc.HostDevice(capacity="16MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    ptrs = [va.allocate(MC) for _ in range(8)]  # 8 one-chunk ranges, 8 reservations
    for p in ptrs[::2]:
        va.deallocate(p)
    for p in ptrs[1::2]:
        va.deallocate(p)
    c = va.chunk_stats()
    assert (c["cached_ranges"], c["reservations"], c["free_chunks"]) == (8, 8, 8)
    before = dev.counters()
    big = va.allocate(16 * MiB)
    # No chunk is created: every one is unmapped from the cache and remapped; every emptied
    # reservation is freed, so no address space leaks.
    assert delta(before, dev.counters()) == {"unmap": 8, "free_address": 8, "reserve": 1,
                                             "map": 8, "set_access": 1}
    c = va.chunk_stats()
    assert (c["reservations"], c["chunks_stolen"], c["chunks_held"], c["cached_ranges"]) == (
        1, 8, 8, 0)
    check_identities(va, {big: 16 * MiB})


def test_stealing_takes_empty_arena_chunks_too():
    dev = vmalloc.HostDevice(capacity="8MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    smalls = [va.allocate(600 * KiB) for _ in range(9)]  # 3 per chunk: 3 arena chunks
    assert va.chunk_stats()["chunks_in_arenas"] == 3
    for p in smalls:
        va.deallocate(p)
    c = va.chunk_stats()
    # One empty arena chunk stays as a spare, the others rejoined the range cache; all free.
    assert c["free_chunks"] == 3 and c["chunks_in_arenas"] == 1
    assert va.allocate(8 * MiB)
    assert va.chunk_stats()["chunks_in_arenas"] == 0


SIZES = st.one_of(st.integers(1, 64 * KiB), st.integers(64 * KiB, MiB),
                  st.integers(MiB + 1, 7 * MC))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(SIZES, min_size=1, max_size=40), data=st.data())
def test_no_out_of_memory_while_enough_free_chunks_exist(sizes, data):
    capacity_chunks = 24
    dev = vmalloc.HostDevice(capacity=capacity_chunks * MC, backed=False)
    va = vmalloc.VirtualAllocator(dev)
    live = {}
    for n in sizes:  # fill, fragmenting the address space
        try:
            live[va.allocate(n)] = n
        except vmalloc.OutOfMemoryError:
            c = va.chunk_stats()
            needed = 1 if n <= va.small_threshold else chunks(n)
            assert c["free_chunks"] + capacity_chunks - c["chunks_held"] < needed
    order = data.draw(st.permutations(sorted(live)))
    freed = data.draw(st.integers(0, len(order)))
    for p in order[:freed]:
        va.deallocate(p, live.pop(p))
    check_identities(va, live)
    c = va.chunk_stats()
    free = c["free_chunks"] + (capacity_chunks - c["chunks_held"])
    if free == 0:
        return
    k = data.draw(st.integers(1, free))
    n = data.draw(st.integers(max((k - 1) * MC + 1, MiB + 1), k * MC))
    p = va.allocate(n)  # must not raise, whatever the fragmentation
    live[p] = n
    check_identities(va, live)
    assert va.stats().reserved_bytes <= dev.capacity


def test_failure_after_stealing_leaves_accounting_unchanged():
    """A driver call refused after chunks were stolen: the request fails, the stolen chunks
    wait in the pool's cache, the created one is released, and the books are unchanged."""
    H = vmalloc.HostDevice
    # backed: its mappings count against the process's VMA limit. Unchecked: checked mode's
    # guards of the freed chunks are VMAs too, so the limits below would fall elsewhere.
    dev = H(capacity=9 * MC, checked=False)
    va = vmalloc.VirtualAllocator(dev)
    va.deallocate(va.allocate(8 * MC))
    x = va.allocate(MC)  # keeps the 8-chunk reservation alive; 7 chunks stay cached
    stats = va.stats()
    limit = H.vma_limit()
    failures = []
    try:
        # The tightest limits refuse cuMemAddressReserve, then (once the reservation fits)
        # the cuMemMap calls after stealing; a loose one lets the request through.
        for extra in range(0, 64):
            H.set_vma_limit(H.process_vmas() + extra)
            try:
                p = va.allocate(8 * MC)
                break
            except vmalloc.DeviceError as e:
                failures.append((e.call, va.chunk_stats()["chunks_in_pool"]))
                assert va.stats() == stats
                c = va.chunk_stats()
                assert c["chunks_held"] == 8 and c["free_chunks"] == 7
    finally:
        H.set_vma_limit(limit)
    assert ("cuMemMap", 7) in failures  # a failure after stealing happened and was undone
    s, c = check_identities(va, {x: MC, p: 8 * MC})
    assert (c["chunks_held"], c["chunks_in_pool"], c["reservations"]) == (9, 0, 2)
    dev.write(p + 8 * MC - 4, b"tail")
    assert dev.read(p + 8 * MC - 4, 4) == b"tail"


def test_release_cached_returns_exact_bytes():
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    keep = [va.allocate(5 * MiB), va.allocate(1000)]
    gone = [va.allocate(9 * MiB), va.allocate(3 * MiB), va.allocate(2000)]
    spare = [va.allocate(800 * KiB) for _ in range(3)]  # a second arena chunk, emptied below
    for p in gone + spare:
        va.deallocate(p)
    c = va.chunk_stats()
    free = c["free_chunks"]
    assert free == 5 + 2 + 1  # the 9 MiB and 3 MiB ranges, and one empty arena chunk
    assert va.release_cached() == free * MC
    s, c = check_identities(va, {keep[0]: 5 * MiB, keep[1]: 1000})
    assert s.reserved_bytes == (3 + 1) * MC == dev.physical_bytes_in_use
    assert (c["free_chunks"], c["cached_ranges"]) == (0, 0)
    assert va.release_cached() == 0
    for p in keep:
        va.deallocate(p)
    assert va.release_cached() == 4 * MC
    assert dev.state()["reservations"] == 0 and dev.physical_bytes_in_use == 0


# --- the small-block arena ---------------------------------------------------------------

def test_small_requests_share_a_chunk_in_512_byte_blocks():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    live = {}
    for i in range(300):
        n = 3000 + i
        p = va.allocate(n)
        assert p % 512 == 0
        live[p] = n
        dev.write(p, bytes([i % 251]) * 8)
    s, c = check_identities(va, live)
    assert c["chunks_in_arenas"] == 1  # 300 blocks of at most 3.5 KiB fit one 2 MiB chunk
    assert s.internal_fragmentation_bytes < 512 * 300
    for i, p in enumerate(live):
        assert dev.read(p, 8) == bytes([i % 251]) * 8
    for p in list(live):
        va.deallocate(p, live.pop(p))
    s, c = check_identities(va, live)
    assert (c["free_blocks"], c["arena_chunks_empty"], c["arena_free_bytes"]) == (1, 1, MC)


def test_small_blocks_split_and_merge_best_fit():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    a, b, c, d = (va.allocate(n) for n in (1000, 5000, 1000, 20000))
    assert (b - a, c - b, d - c) == (1024, 5120, 1024)  # packed in address order
    va.deallocate(b)
    assert va.allocate(4000) == b  # best fit: the 5 KiB hole, not the chunk's tail
    e = va.allocate(1024)
    assert e == b + 4096  # the rest of that hole
    va.deallocate(a)
    va.deallocate(b)
    va.deallocate(e)  # a, b and e merge into one 6 KiB block before c
    assert va.allocate(6 * KiB) == a
    check_identities(va)


def test_empty_arena_chunks_rejoin_the_range_cache():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    base = va.allocate(6 * MC)
    va.deallocate(base)
    smalls = [va.allocate(MiB) for _ in range(6)]  # 2 per chunk: split off the cached range
    assert va.chunk_stats()["chunks_in_arenas"] == 3
    assert min(smalls) == base
    for p in smalls:
        va.deallocate(p)
    c = va.chunk_stats()
    assert (c["chunks_in_arenas"], c["arena_chunks_empty"]) == (1, 1)  # the spare
    # The two retired chunks merged with the rest of the range: one range of 5 chunks.
    assert (c["cached_ranges"], c["chunks_cached"]) == (1, 5)
    va.release_cached()
    before = dev.counters()
    assert va.allocate(6 * MC) != 0
    assert delta(before, dev.counters())["create"] == 6


def test_small_threshold_zero_disables_the_arena():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev, small_threshold=0)
    p = va.allocate(1)
    s, c = check_identities(va, {p: 1})
    assert (s.allocated_bytes, c["chunks_in_arenas"]) == (MC, 0)


def test_reset_peak_stats_sets_peaks_to_current_values():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    a, b = va.allocate(9 * MiB), va.allocate(1000)
    va.deallocate(a)
    s = va.stats()
    assert (s.peak_requested_bytes, s.peak_allocated_bytes, s.peak_live_allocations) == (
        9 * MiB + 1000, 5 * MC + 1024, 2)
    va.reset_peak_stats()
    s = va.stats()
    assert (s.peak_requested_bytes, s.peak_allocated_bytes, s.peak_live_allocations,
            s.peak_internal_fragmentation_bytes, s.peak_reserved_bytes) == (
        1000, 1024, 1, 24, s.reserved_bytes)
    va.release_cached()
    assert va.stats().peak_reserved_bytes == 6 * MC  # a peak stays until the next reset
    va.reset_peak_stats()
    assert va.stats().peak_reserved_bytes == MC == va.stats().reserved_bytes
    assert b


# --- errors ------------------------------------------------------------------------------

def test_bad_pointers_raise_and_change_nothing():
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev)
    big = va.allocate(5 * MiB)
    small = va.allocate(3000)
    freed = va.allocate(4 * MiB)
    va.deallocate(freed)
    freed_small = va.allocate(100)
    va.deallocate(freed_small)
    stats, calls = va.stats(), dev.counters()
    cases = [
        (big + 512, vmalloc.InvalidPointerError, "interior pointer"),
        (big + 2 * MiB, vmalloc.InvalidPointerError, "interior pointer"),
        (small + 512, vmalloc.InvalidPointerError, "interior pointer"),
        (freed, vmalloc.InvalidPointerError, "already freed"),
        (freed_small, vmalloc.InvalidPointerError, "already freed"),
        (12345 * 4096, vmalloc.InvalidPointerError, "not allocated by this allocator"),
    ]
    for ptr, error, words in cases:
        with pytest.raises(error, match=words) as info:
            va.deallocate(ptr)
        assert type(info.value) is error
        with pytest.raises(error):
            va.allocation_size(ptr)
    for ptr, n in ((big, 5 * MiB - 1), (small, 3001), (small, 0)):
        with pytest.raises(vmalloc.InvalidArgumentError, match="differs") as info:
            va.deallocate(ptr, n)
        assert type(info.value) is vmalloc.InvalidArgumentError
    for n in (-1, 2**56 + 1, "lots", 1.5):
        with pytest.raises(vmalloc.InvalidArgumentError):
            va.allocate(n)
    assert va.stats() == stats
    assert delta(calls, dev.counters()) == {}
    assert (va.allocation_size(big), va.allocation_size(small)) == (5 * MiB, 3000)
    va.deallocate(big, 5 * MiB)
    va.deallocate(small, 3000)
    with pytest.raises(vmalloc.InvalidPointerError):
        va.deallocate(big)  # double free


# --- streams -----------------------------------------------------------------------------

def pinned(dev, n):
    return dev.host_alloc(n)


def host_bytes(addr, n):
    return ctypes.string_at(addr, n)


@pytest.mark.parametrize("n", [3000, 3 * MiB], ids=["small", "chunks"])
@pytest.mark.parametrize("multi_stream_at_free", [False, True], ids=["late-event", "free-event"])
def test_reuse_on_another_stream_waits_for_the_freeing_stream(n, multi_stream_at_free):
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    a, b = dev.create_stream(), dev.create_stream()
    if multi_stream_at_free:  # the allocator has seen two streams: events at free time
        va.deallocate(va.allocate(64, b), 64, b)
    x = va.allocate(n, a)
    dev.write(x, b"P1" * 8, a)
    hold = dev.hold_stream(a)  # work queued on `a` now cannot run yet
    out = pinned(dev, 16)
    dev.copy_to_host(out, x, 16, a)  # the last use of x on `a`, still pending at the free
    va.deallocate(x, n, a)
    before = dev.counters()
    y = va.allocate(n, b)
    assert y == x  # reused at once...
    after = dev.counters()
    assert after["stream_wait_event"] - before["stream_wait_event"] == 1  # ...ordered, no block
    assert after["event_synchronize"] == before["event_synchronize"]
    dev.copy_to_device(y, ctypes.addressof(P2_BUFFER), 16, b)  # would clobber x's data early
    dev.release_hold(hold)
    dev.synchronize()
    assert host_bytes(out, 16) == b"P1" * 8  # `a` read its data before `b` overwrote it
    assert dev.read(y, 16) == b"P2" * 8
    dev.host_free(out)


P2_BUFFER = ctypes.create_string_buffer(b"P2" * 8, 16)


def test_reuse_on_the_freeing_stream_is_immediate_and_call_free():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    a = dev.create_stream()
    x = va.allocate(3 * MiB, a)
    hold = dev.hold_stream(a)
    va.deallocate(x, 3 * MiB, a)
    before = dev.counters()
    assert va.allocate(3 * MiB, a) == x
    assert delta(before, dev.counters(), list(before)) == {}
    dev.release_hold(hold)


def test_completed_free_is_preferred_for_another_stream():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    a, b = dev.create_stream(), dev.create_stream()
    va.deallocate(va.allocate(64, b), 64, b)  # two streams seen: frees record events
    x1, x2 = va.allocate(3 * MiB, a), va.allocate(3 * MiB, a)
    va.deallocate(x1, 3 * MiB, a)  # completes: nothing is queued on `a`
    dev.synchronize()
    hold = dev.hold_stream(a)
    va.deallocate(x2, 3 * MiB, a)  # pending: `a` is held
    # x2 is the most recently freed, but its free is pending; x1's has completed.
    before = dev.counters()
    assert va.allocate(3 * MiB, b) == x1
    assert dev.counters()["stream_wait_event"] == before["stream_wait_event"]
    dev.release_hold(hold)


def test_unmapping_waits_for_the_freeing_stream():
    # The copy must still be queued when the allocator looks: a hold keeps it queued (without
    # one the copy often finishes first on a slow machine and nothing is left to wait for). The
    # allocation then has to block, so it runs on a thread, and the hold is released once the
    # allocator has entered its wait, seen by the counter (counted work, no timing).
    dev = vmalloc.HostDevice(capacity="8MiB")
    va = vmalloc.VirtualAllocator(dev)
    a = dev.create_stream()
    x = va.allocate(4 * MiB, a)
    z = va.allocate(4 * MiB, a)
    out = pinned(dev, 16)
    dev.write(x + 4 * MiB - 16, b"P1" * 8, a)  # synchronous
    hold = dev.hold_stream(a)
    dev.copy_to_host(out, x + 4 * MiB - 16, 16, a)
    va.deallocate(x, 4 * MiB, a)
    va.deallocate(z, 4 * MiB, a)
    waits = dev.counters()["event_synchronize"]
    result = {}

    def allocate():
        # 8 MiB: no cached range is large enough, so both are stolen, which unmaps them: the
        # allocator must first wait for the copy queued on `a`.
        result["y"] = va.allocate(8 * MiB, a)

    worker = threading.Thread(target=allocate)
    worker.start()
    while worker.is_alive() and dev.counters()["event_synchronize"] == waits:
        time.sleep(0.001)
    entered_wait = dev.counters()["event_synchronize"] > waits
    dev.release_hold(hold)
    worker.join()
    assert entered_wait  # it waited for the stream rather than unmapping under the copy
    assert va.chunk_stats()["chunks_stolen"] == 4
    y = result["y"]
    dev.write(y, b"\0" * (8 * MiB))
    dev.synchronize()
    assert host_bytes(out, 16) == b"P1" * 8
    dev.host_free(out)


def test_release_cached_waits_for_pending_frees():
    dev = vmalloc.HostDevice(capacity="8MiB")
    va = vmalloc.VirtualAllocator(dev)
    a = dev.create_stream()
    x = va.allocate(4 * MiB, a)
    dev.write(x, b"P1" * 8, a)
    out = pinned(dev, 16)
    dev.copy_to_host(out, x, 16, a)
    va.deallocate(x, 4 * MiB, a)
    assert va.release_cached() == 4 * MiB
    assert host_bytes(out, 16) == b"P1" * 8  # the copy ran before the unmap
    dev.synchronize()
    dev.host_free(out)


def test_events_are_pooled_after_warm_up():
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    a, b = dev.create_stream(), dev.create_stream()
    for _ in range(3):  # warm-up
        for s in (a, b):
            p = va.allocate(3 * MiB, s)
            q = va.allocate(1000, s)
            va.deallocate(p, 3 * MiB, s)
            va.deallocate(q, 1000, s)
    dev.synchronize()
    before = dev.counters()
    for _ in range(50):
        for s in (a, b):
            p = va.allocate(3 * MiB, s)
            q = va.allocate(1000, s)
            va.deallocate(p, 3 * MiB, s)
            va.deallocate(q, 1000, s)
    after = dev.counters()
    assert after["event_create"] == before["event_create"]
    assert after["memory_management_calls"] == before["memory_management_calls"]
    assert va.chunk_stats()["multi_stream"] is True


def test_a_destroyed_freeing_stream_does_not_block_reuse():
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    va = vmalloc.VirtualAllocator(dev)
    a, b = dev.create_stream(), dev.create_stream()
    x = va.allocate(3 * MiB, a)
    va.deallocate(x, 3 * MiB, a)  # single stream so far: no event recorded at free
    dev.destroy_stream(a)
    assert va.allocate(3 * MiB, b) == x


def test_destruction_returns_everything_to_the_device():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    s = dev.create_stream()
    live = [va.allocate(n, s) for n in (100, 5 * MiB, 2 * MiB, 700 * KiB)]
    va.deallocate(live.pop(), None, s)
    assert dev.state()["mappings"] > 0
    del va
    state = dev.state()
    assert (state["physical_allocations"], state["reservations"], state["mappings"],
            state["events"]) == (0, 0, 0, 0)


# --- the benchmark (counts only: timings are never asserted) -------------------------------

def test_bench_reports_zero_steady_state_calls(capsys):
    import json

    from vmalloc import bench

    assert bench.main(["--quick", "--json", "--allocator", "virtual", "--sizes", "4KiB,3MiB"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [h["nbytes"] for h in results["hit"]] == [4 * KiB, 3 * MiB]
    assert all(h["cpp_ns_per_pair"] > 0 and h["python_ns_per_pair"] > 0 for h in results["hit"])
    (run,) = results["pattern"]
    first, *steady = run["iterations"]
    assert first["memory_management_calls"] > 0 and first["modeled_seconds"] > 0
    assert [r["memory_management_calls"] for r in steady] == [0] * len(steady)
    assert [r["modeled_seconds"] for r in steady] == [0.0] * len(steady)
    assert bench.main(["--quick", "--allocator", "virtual"]) == 0
    assert "training-like pattern" in capsys.readouterr().out


# --- streams under random operations and memory pressure --------------------------------

from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)


class MultiStreamMachine(RuleBasedStateMachine):
    """Random allocations and frees on three streams of a small backed device: frees on
    other streams than the allocation's, neighbours freed on different streams, arena chunks
    emptied by several streams, stealing (which synchronizes) and release_cached. Data of live
    allocations must survive, and the books must stay exact."""

    def __init__(self):
        super().__init__()
        self.device = vmalloc.HostDevice(capacity=12 * MC)
        self.va = vmalloc.VirtualAllocator(self.device)
        self.streams = [0] + [self.device.create_stream() for _ in range(2)]
        self.live = {}  # ptr -> (n, tag)
        self.tag = 0

    @rule(n=st.one_of(st.integers(1, 8 * KiB), st.integers(8 * KiB, MiB),
                      st.integers(MiB + 1, 5 * MC)),
          s=st.integers(0, 2))
    def allocate(self, n, s):
        try:
            p = self.va.allocate(n, self.streams[s])
        except vmalloc.OutOfMemoryError:
            c = self.va.chunk_stats()
            needed = 1 if n <= self.va.small_threshold else chunks(n)
            assert c["free_chunks"] + 12 - c["chunks_held"] < needed
            return
        self.tag += 1
        data = self.tag.to_bytes(4, "little") * 2
        k = min(8, n)
        self.device.write(p, data[:k], self.streams[s])
        self.device.write(p + n - k, data[:k], self.streams[s])  # the same bytes if n < 16
        self.live[p] = (n, self.tag)

    @rule(data=st.data(), s=st.integers(0, 2))
    def deallocate(self, data, s):
        # Which allocations fail depends on mmap's addresses and on stream timing, so the live
        # set may differ on replay: the draw must not depend on it (see pick in
        # test_allocator_protocol.py), and the choice is made in allocation order.
        i = data.draw(st.integers(0, (1 << 16) - 1), label="index")
        if not self.live:
            return
        p = list(self.live)[i % len(self.live)]
        n, tag = self.live.pop(p)
        k = min(8, n)
        expect = (tag.to_bytes(4, "little") * 2)[:k]
        assert self.device.read(p + n - k, k) == expect
        if n >= 2 * k:  # else the tail write overlapped the head
            assert self.device.read(p, k) == expect
        # Queue a copy that still reads the memory at the free, on the freeing stream.
        self.device.copy_device(p, p, k, self.streams[s])
        self.va.deallocate(p, n, self.streams[s])

    @rule()
    def release_cached(self):
        free = self.va.chunk_stats()["free_chunks"]
        assert self.va.release_cached() == free * MC

    @invariant()
    def books(self):
        check_identities(self.va, {p: n for p, (n, _) in self.live.items()})

    def teardown(self):
        self.device.synchronize()
        for p, (n, tag) in self.live.items():
            k = min(8, n)
            assert self.device.read(p + n - k, k) == (tag.to_bytes(4, "little") * 2)[:k]
        self.va = self.device = None


def test_multi_stream_random_operations():
    run_state_machine_as_test(
        MultiStreamMachine,
        settings=settings(max_examples=int(__import__("os").environ.get("VA_EXAMPLES", 25)), stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]))


# --- the small-block arena's best fit, against a model ----------------------------------------

def _gaps(base, size, blocks):
    """Free gaps (start, length) of an arena chunk at `base` of `size` bytes with live
    `blocks` ({start: length}): single-stream frees always merge, so free memory is maximal."""
    gaps, at = [], base
    for start in sorted(blocks):
        if start > at:
            gaps.append((at, start - at))
        at = start + blocks[start]
    if at < base + size:
        gaps.append((at, base + size - at))
    return gaps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mc=st.sampled_from([2 * MiB, 32 * MiB]), data=st.data())
def test_small_blocks_take_the_best_fitting_gap(mc, data):
    """Every small request takes the front of the smallest free gap that fits it, across all
    arena chunks (ties: any), or a new arena chunk if none fits; frees merge; one empty chunk
    stays as the spare, further empty ones leave the arena. 2 MiB and 32 MiB chunks put the
    size buckets' bitmap at two and three levels."""
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev, chunk_size=mc)
    small = st.one_of(st.integers(1, 8 * KiB), st.integers(1, 256 * KiB),
                      st.integers(1, va.small_threshold))
    arena = {}    # chunk base -> {block start: rounded length}
    owner = {}    # live pointer -> (chunk base, requested)
    spare = None
    for _ in range(data.draw(st.integers(1, 120), label="steps")):
        if owner and data.draw(st.booleans(), label="free"):
            p = data.draw(st.sampled_from(sorted(owner)), label="ptr")
            base, n = owner.pop(p)
            va.deallocate(p, n)
            del arena[base][p]
            if not arena[base]:
                if spare is None:
                    spare = base
                else:
                    del arena[base]  # rejoins the range cache
        else:
            n = data.draw(small, label="n")
            r = -(-n // 512) * 512
            fits = [g for base in arena for g in _gaps(base, mc, arena[base]) if g[1] >= r]
            held = va.chunk_stats()["chunks_in_arenas"]
            p = va.allocate(n)
            if fits:
                best = min(length for _, length in fits)
                assert p in {start for start, length in fits if length == best}
                base = next(b for b in arena if b <= p < b + mc)
                assert va.chunk_stats()["chunks_in_arenas"] == held
            else:
                assert va.chunk_stats()["chunks_in_arenas"] == held + 1
                base = p  # a new arena chunk: its first block is at its base
                assert base not in arena
                arena[base] = {}
            if base == spare:
                spare = None
            arena[base][p] = r
            owner[p] = (base, n)
        c = va.chunk_stats()
        assert c["chunks_in_arenas"] == len(arena)
        assert c["live_blocks"] == len(owner)
        assert c["free_blocks"] == sum(len(_gaps(b, mc, arena[b])) for b in arena)
        assert c["arena_free_bytes"] == len(arena) * mc - sum(
            sum(blocks.values()) for blocks in arena.values())
    check_identities(va, {p: n for p, (_, n) in owner.items()})


# --- chunk placement: steal before create -----------------------------------------------------

def test_steal_before_create_option():
    dev = vmalloc.HostDevice(backed=False)
    assert vmalloc.VirtualAllocator(dev).steal_before_create is False  # the default
    assert vmalloc.VirtualAllocator(dev, steal_before_create=True).steal_before_create is True
    assert vmalloc.VirtualAllocator(dev, steal_before_create=False).steal_before_create is False
    with pytest.raises(TypeError, match="steal_before_create"):
        vmalloc.VirtualAllocator(dev, steal_before_create="yes")
    with pytest.raises(vmalloc.InvalidArgumentError, match="packed"):
        vmalloc.VirtualAllocator(dev, reservation_size="64MiB")


@pytest.mark.parametrize("steal, calls, held, stolen", [
    # Create first: the cached 3-chunk range stays for the next iteration; 4 new chunks.
    (False, {"create": 4, "reserve": 1, "map": 4, "set_access": 1}, 7, 0),
    # Steal first: the cached range is unmapped (one call, its reservation freed) and its 3
    # chunks remapped with 1 new one.
    (True, {"create": 1, "reserve": 1, "free_address": 1, "map": 4, "unmap": 1,
            "set_access": 1}, 4, 3),
])
def test_steal_before_create_reuses_cached_chunks_before_creating(steal, calls, held, stolen):
    dev = vmalloc.HostDevice(backed=False)  # unlimited: no pressure ever forces stealing
    va = vmalloc.VirtualAllocator(dev, steal_before_create=steal)
    va.deallocate(va.allocate(3 * MC))
    before = dev.counters()
    p = va.allocate(4 * MC)  # misses: no cached range of 4 chunks
    assert delta(before, dev.counters()) == calls
    c = va.chunk_stats()
    assert (c["chunks_held"], c["chunks_stolen"], c["reservations"]) == (
        held, stolen, 2 if not steal else 1)
    assert dev.counters()["event_record"] - before["event_record"] == (1 if steal else 0)
    check_identities(va, {p: 4 * MC})


def test_steal_first_trades_driver_calls_for_memory():
    """A step whose shapes shift (a 3-chunk request after two 2-chunk ones, one freed):
    create first holds 7 chunks and makes no call after the first step; steal first holds 5
    and remaps 3 chunks every step."""
    def steps(steal):
        dev = vmalloc.HostDevice(backed=False)
        va = vmalloc.VirtualAllocator(dev, steal_before_create=steal)
        rows = []
        for _ in range(4):
            before = dev.counters()
            a, b = va.allocate(2 * MC), va.allocate(2 * MC)
            va.deallocate(a)
            c = va.allocate(3 * MC)
            va.deallocate(b)
            va.deallocate(c)
            rows.append(delta(before, dev.counters()))
        check_identities(va, {})
        return rows, va.chunk_stats()["peak_chunks_held"]

    assert steps(False) == ([{"create": 7, "reserve": 3, "map": 7, "set_access": 3}, {}, {}, {}],
                            7)
    again = {"reserve": 1, "free_address": 1, "map": 3, "unmap": 2, "set_access": 1}
    assert steps(True) == ([{"create": 5, "reserve": 3, "free_address": 1, "map": 7,
                             "unmap": 1, "set_access": 3}, again, again, again], 5)


def test_training_pattern_is_call_free_after_warm_up_by_default():
    """The bench's training-like pattern: with the default (create first) no memory-management
    call after the first step; stealing first holds fewer chunks but remaps every step."""
    from vmalloc import bench

    def run(**options):
        dev = bench.make_device()
        va = vmalloc.VirtualAllocator(dev, **options)
        sizes = bench.training_layers(48)
        params = [va.allocate(n) for n in sizes]
        calls = []
        for _ in range(4):
            before = dev.counters()
            bench.training_step(va, sizes)
            calls.append(dev.counters()["memory_management_calls"]
                         - before["memory_management_calls"])
        for p, n in zip(params, sizes):
            va.deallocate(p, n)
        return calls, va.chunk_stats()["peak_chunks_held"]

    default_calls, default_held = run()
    assert default_calls[1:] == [0, 0, 0]
    assert run(steal_before_create=False) == (default_calls, default_held)
    steal_calls, steal_held = run(steal_before_create=True)
    assert steal_held < default_held
    assert all(n > 0 for n in steal_calls[1:])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 1 << 16)), min_size=1,
                    max_size=60))
def test_steal_first_holds_exactly_the_peak_of_what_is_in_use(ops):
    """With stealing first (one stream, no capacity limit) a miss creates chunks only when no
    free chunk is left but the arena's spare, so the chunks held peak at exactly the peak of
    chunks in live ranges and arenas."""
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev, steal_before_create=True)
    live = {}
    peak_in_use = 0
    for free, n, pick in ops:
        if free and live:
            p = sorted(live)[pick % len(live)]
            va.deallocate(p, live.pop(p))
        else:
            live[va.allocate(n)] = n
        c = va.chunk_stats()
        peak_in_use = max(peak_in_use, c["chunks_live"] + c["chunks_in_arenas"])
        assert c["peak_chunks_held"] == peak_in_use
    check_identities(va, live)


def test_map_failing_inside_a_run_is_counted_and_undone():
    """The chunks of one allocation are mapped in one device call (HostDevice.map_chunks):
    a refusal at the fourth chunk leaves three mapped, each counted as a cuMemMap, and the
    allocator undoes all of it (the same calls as one map per chunk made)."""
    import gc

    from vmalloc import HostDevice

    dev = HostDevice(checked=False)
    a = vmalloc.VirtualAllocator(dev, chunk_size="2MiB")
    limit = HostDevice.vma_limit()
    gc.collect()   # no other device's teardown gives VMAs back in the middle
    try:
        # the reservation, then three chunks of two VMAs each
        HostDevice.set_vma_limit(HostDevice.process_vmas() + 1 + 2 * 3)
        with pytest.raises(vmalloc.DeviceError, match="memory mappings"):
            a.allocate(8 << 20)
    finally:
        HostDevice.set_vma_limit(limit)
    c, s = dev.counters(), dev.state()
    assert {k: c[k] for k in ("create", "reserve", "map", "set_access", "unmap", "release",
                              "free_address")} == {
        "create": 4, "reserve": 1, "map": 4, "set_access": 0, "unmap": 1, "release": 4,
        "free_address": 1}
    assert (s["mappings"], s["reservations"], s["bytes_created"]) == (0, 0, 0)
    p = a.allocate(8 << 20)
    assert dev.state()["mappings"] == 4
    a.deallocate(p)
