"""The SwapManager's exact behaviour: driver calls of a round trip, pointer stability, the
allocator's books for unbacked allocations, out-of-memory at swap-in (with and without
swap-outs in flight), the host capacity, invalid calls, relocation, and every state of
deallocate."""

import threading

import pytest

import vmalloc
from vmalloc import offload

MiB = 1 << 20


@pytest.fixture(params=["host", "cuda-emulator"])
def make_dev(request):
    if request.param == "host":
        return lambda **o: vmalloc.HostDevice(**o)
    from vmalloc import testing

    return lambda **o: testing.emulated_cuda_device(**o)


def hold(device, stream):
    """Blocks `stream` until the returned release() is called."""
    if isinstance(device, vmalloc.HostDevice):
        token = device.hold_stream(stream)
        return lambda: device.release_hold(token)
    from vmalloc import testing

    emu = testing.emulator()
    token = emu.hold_stream(stream)
    return lambda: emu.release_hold(token)


def release_later(release, seconds=0.3):
    t = threading.Timer(seconds, release)
    t.start()
    return t


def calls(device):
    c = device.counters()
    return {k: v for k, v in c.items() if isinstance(v, int)}


def delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def fill(device, ptr, n, seed):
    data = bytes((seed * 31 + i) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)
    device.write(ptr, data[:n])
    return data[:n]


# --- one round trip, exactly ---

def test_round_trip_of_a_three_chunk_allocation_makes_exactly_these_calls(make_dev):
    dev = make_dev(capacity="64MiB", granularity="2MiB")
    va = vmalloc.VirtualAllocator(dev, chunk_size="2MiB")
    swap = offload.SwapManager(va)
    p = va.allocate(5 * MiB)  # 3 chunks
    data = fill(dev, p, 5 * MiB, 1)
    before = calls(dev)
    swap.swap_out(p)
    dev.synchronize()
    swap.poll()
    assert swap.state(p) == "on_host"
    out = delta(before, calls(dev))
    # One cuMemUnmap covers the three adjacent chunk mappings; nothing is released or created.
    assert {k: out.get(k, 0) for k in ("unmap", "map", "set_access", "create", "release",
                                       "host_alloc", "copy_to_host", "event_create",
                                       "event_record", "stream_wait_event")} == {
        "unmap": 1, "map": 0, "set_access": 0, "create": 0, "release": 0, "host_alloc": 1,
        "copy_to_host": 1, "event_create": 2, "event_record": 2, "stream_wait_event": 1}
    assert out["bytes_to_host"] == 5 * MiB
    c = va.chunk_stats()
    assert (c["chunks_unbacked"], c["unbacked_ranges"], c["chunks_in_pool"], c["chunks_live"]) == (3, 1, 3, 0)

    before = calls(dev)
    # The copy is held on the manager's H2D stream until wait() has run, so wait() always
    # finds it in flight and queues the caller's device-side wait (a copy that had already
    # landed would be retired by wait()'s poll first, skipping that cuStreamWaitEvent).
    release = hold(dev, swap.streams[1])
    try:
        assert swap.swap_in(p) == p  # the same pointer
        assert swap.state(p) == "swapping_in"
        swap.wait(p)
    finally:
        release()
    dev.synchronize()
    swap.poll()
    assert swap.state(p) == "resident"
    back = delta(before, calls(dev))
    assert {k: back.get(k, 0) for k in ("unmap", "map", "set_access", "create", "release",
                                        "host_alloc", "host_free", "copy_to_device",
                                        "event_create", "event_record",
                                        "stream_wait_event")} == {
        "unmap": 0, "map": 3, "set_access": 1, "create": 0, "release": 0, "host_alloc": 0,
        "host_free": 0, "copy_to_device": 1, "event_create": 0, "event_record": 2,
        "stream_wait_event": 2}  # the H2D stream waits for the caller, the caller for the copy
    assert dev.read(p, 5 * MiB) == data
    c = va.chunk_stats()
    assert (c["chunks_unbacked"], c["chunks_in_pool"], c["chunks_live"]) == (0, 0, 3)
    s = swap.stats()
    assert (s["swap_outs"], s["swap_ins"], s["bytes_swapped_out"], s["bytes_swapped_in"]) == (
        1, 1, 5 * MiB, 5 * MiB)
    assert (s["relocations"], s["host_bytes_in_use"], s["host_bytes_cached"]) == (0, 0, 6 * MiB)
    assert s["peak_host_bytes_in_use"] == 6 * MiB  # 5 MiB rounds to the 6 MiB class


def test_swapped_out_range_is_inaccessible_and_books_exclude_it():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    p = va.allocate(3 * MiB)
    fill(dev, p, 3 * MiB, 2)
    before = va.stats()
    swap.swap_out(p)
    swap.wait(p)
    assert swap.state(p) == "on_host"
    for call in (lambda: dev.read(p, 16), lambda: dev.read(p + MiB, 1),
                 lambda: dev.write(p, b"x")):
        with pytest.raises(vmalloc.DeviceError, match=f"{p:#x}|not mapped"):
            call()
    s = va.stats()
    assert s.live_allocations == before.live_allocations == 1
    assert s.allocated_bytes == 0 and s.requested_bytes == 0
    assert s.reserved_bytes == before.reserved_bytes  # the chunks wait in the pool
    assert va.chunk_stats()["unbacked_bytes"] == 3 * MiB
    # The allocator's own deallocate frees an unbacked allocation: its range goes.
    swap.deallocate(p)
    assert va.stats().live_allocations == 0
    assert va.chunk_stats()["reservations"] == 0
    assert dev.state()["host_allocations"] == 1  # the cached staging block
    assert swap.release_cached_host() == 4 * MiB
    assert dev.state()["host_allocations"] == 0


def test_unmap_backing_and_map_backing_directly():
    dev = vmalloc.HostDevice(capacity="16MiB")
    va = vmalloc.VirtualAllocator(dev)
    p = va.allocate(4 * MiB)
    small = va.allocate(1000)
    assert va.owns_chunks(p) and not va.owns_chunks(small)
    with pytest.raises(vmalloc.InvalidArgumentError, match="small block"):
        va.unmap_backing(small)
    va.unmap_backing(p)
    with pytest.raises(vmalloc.InvalidArgumentError, match="already unbacked"):
        va.unmap_backing(p)
    va.map_backing(p)
    with pytest.raises(vmalloc.InvalidArgumentError, match="is backed"):
        va.map_backing(p)
    dev.write(p, b"ok")
    assert dev.read(p, 2) == b"ok"
    packed = vmalloc.VirtualAllocator(dev, placement="packed")
    q = packed.allocate(4 * MiB)
    assert packed.owns_chunks(q) is False
    with pytest.raises(vmalloc.InvalidArgumentError, match="chunks"):
        packed.unmap_backing(q)


# --- out of memory ---

def test_out_of_memory_at_swap_in_keeps_the_data_on_host(make_dev):
    dev = make_dev(capacity="8MiB", granularity="2MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    a = va.allocate(6 * MiB)
    data = fill(dev, a, 6 * MiB, 3)
    swap.swap_out(a)
    swap.wait(a)
    b = va.allocate(8 * MiB)  # every chunk of the device
    with pytest.raises(vmalloc.OutOfMemoryError):
        swap.swap_in(a)
    assert swap.state(a) == "on_host"
    assert swap.stats()["swap_in_failures"] == 1
    assert swap.stats()["host_bytes_in_use"] == 6 * MiB
    va.deallocate(b)
    assert swap.swap_in(a) == a
    swap.wait(a)
    assert dev.read(a, 6 * MiB) == data


@pytest.mark.parametrize("kind", ["virtual", "caching"])
def test_never_out_of_memory_while_swap_outs_in_flight_would_free_enough(make_dev, kind):
    dev = make_dev(capacity="8MiB" if kind == "virtual" else "40MiB", granularity="2MiB")
    if kind == "virtual":
        alloc = vmalloc.VirtualAllocator(dev)
        big, small = 4 * MiB, 4 * MiB
    else:
        # a: one 20 MiB segment; c and f split the other. a's memory, once released, is the
        # only free memory.
        alloc = vmalloc.CachingAllocator(dev)
        big, small = 20 * MiB, 10 * MiB
    swap = offload.SwapManager(alloc)
    s = dev.create_stream()
    a = alloc.allocate(big)
    c = alloc.allocate(small)
    f = alloc.allocate(small) if kind == "caching" else None
    data_a = fill(dev, a, big, 4)
    data_c = fill(dev, c, small, 5)
    kc = swap.swap_out(c)
    swap.wait(kc)
    # Takes c's memory: the device is full again. (c is known by kc now: its old address may
    # name d.)
    d = alloc.allocate(small)
    release = hold(dev, s)
    timer = None
    try:
        ka = swap.swap_out(a, s)  # its copy waits behind the hold: in flight
        assert swap.state(ka) == "swapping_out"
        released = threading.Event()

        def release_marked():
            released.set()     # before the hold goes: a's copy cannot complete earlier
            release()
        timer = release_later(release_marked)
        c2 = swap.swap_in(kc)  # OOM first, then waits for a's copy and takes its memory
        # it returned only once a's copy could complete (no timing asserted: machines are
        # noisy, and the wall time between starting the timer and this call is not ours)
        assert released.is_set()
    finally:
        if timer is None:
            release()
        else:
            timer.join()
    st = swap.stats()
    assert st["oom_retries"] == 1 and st["swap_in_failures"] == 0
    assert st["host_waits"] >= 2 and st["wait_seconds"] > 0
    assert swap.state(ka) == "on_host"
    swap.wait(c2)
    assert dev.read(c2, small) == data_c
    alloc.deallocate(d)
    for p in (c2, f):  # room for a's whole segment again
        if p is not None:
            swap.deallocate(p)
    a2 = swap.swap_in(ka)
    swap.wait(a2)
    assert dev.read(a2, big) == data_a
    swap.deallocate(a2)
    dev.synchronize()
    del swap
    dev.destroy_stream(s)


# --- host capacity ---

def test_host_capacity_exceeded_raises_and_changes_nothing():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va, host_capacity="5MiB")
    p = va.allocate(5 * MiB)  # 6 MiB class
    q = va.allocate(3 * MiB)  # 4 MiB class
    before_calls, before_stats = calls(dev), swap.stats()
    with pytest.raises(vmalloc.OutOfMemoryError, match="host") as info:
        swap.swap_out(p)
    message = str(info.value)
    assert "5242880 bytes" in message and "5.00 MiB" in message  # request and capacity
    assert "in use" in message
    assert swap.state(p) == "resident"
    assert calls(dev) == before_calls and swap.stats() == before_stats
    swap.swap_out(q)
    swap.wait(q)
    with pytest.raises(vmalloc.OutOfMemoryError, match="host capacity"):
        swap.swap_out(va.allocate(2 * MiB))  # 4 MiB in use + 4 MiB class > 5 MiB
    assert swap.stats()["host_bytes_in_use"] == 4 * MiB
    with pytest.raises(vmalloc.InvalidArgumentError):
        offload.SwapManager(va, host_capacity=0)


# --- invalid calls ---

def test_invalid_calls_raise_naming_pointer_and_state_and_change_nothing():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    p = va.allocate(3 * MiB)
    fill(dev, p, 3 * MiB, 6)
    snapshot = lambda: (swap.stats(), calls(dev), va.stats())  # noqa: E731

    before = snapshot()
    with pytest.raises(vmalloc.InvalidArgumentError, match=rf"{p:#x} is resident"):
        swap.swap_in(p)
    with pytest.raises(vmalloc.InvalidPointerError):
        swap.swap_out(p + 512)
    with pytest.raises(vmalloc.InvalidPointerError):
        swap.state(12345 * 4096)
    with pytest.raises(vmalloc.InvalidPointerError):
        swap.wait(12345 * 4096)
    with pytest.raises(vmalloc.DeviceError):
        swap.swap_out(p, stream=0xDEAD000)  # an unknown stream
    with pytest.raises(TypeError):
        swap.swap_out("not a pointer")
    after = snapshot()
    visible = lambda st: {k: v for k, v in st.items() if k != "events_created"}  # noqa: E731
    assert visible(after[0]) == visible(before[0]) and after[2] == before[2]
    assert after[0]["host_alloc_calls"] == 0
    assert swap.state(p) == "resident"
    assert dev.state()["host_allocations"] == 0
    swap.swap_out(p)
    with pytest.raises(vmalloc.InvalidArgumentError, match="swapping_out|on_host"):
        swap.swap_out(p)
    swap.wait(p)
    with pytest.raises(vmalloc.InvalidArgumentError, match=rf"{p:#x} is on_host"):
        swap.swap_out(p)
    with pytest.raises(vmalloc.InvalidArgumentError, match="already swapping in"):
        swap.swap_in(swap.swap_in(p)) if swap.state(p) == "on_host" else None
    swap.deallocate(p)
    with pytest.raises(vmalloc.InvalidPointerError):
        swap.state(p)


def test_swap_out_right_after_swap_in_waits_for_it():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    p = va.allocate(4 * MiB)
    data = fill(dev, p, 4 * MiB, 7)
    for _ in range(3):
        swap.swap_out(p)
        swap.wait(p)
        assert swap.swap_in(p) == p
    swap.swap_out(p)  # may still be swapping in: waited for, then out again
    assert swap.swap_in(p) == p  # may still be swapping out: a cancel
    swap.wait(p)
    assert dev.read(p, 4 * MiB) == data


# --- relocation ---

@pytest.mark.parametrize("placement", ["caching", "packed", "small"])
def test_relocating_allocations_get_a_new_pointer_with_their_data(placement):
    dev = vmalloc.HostDevice(capacity="128MiB")
    if placement == "caching":
        alloc = vmalloc.CachingAllocator(dev)
        n = 3 * MiB
    elif placement == "packed":
        alloc = vmalloc.VirtualAllocator(dev, placement="packed")
        n = 3 * MiB
    else:
        alloc = vmalloc.VirtualAllocator(dev)
        n = 1000
    swap = offload.SwapManager(alloc)
    s = dev.create_stream()
    p = alloc.allocate(n)
    assert swap.relocates(p)
    data = fill(dev, p, n, 8)
    key = swap.swap_out(p)
    assert key != p                      # a host address names it from now on
    # p names it too while it holds p (the copy may already have completed)
    assert swap.state(p) in ("swapping_out", "on_host")
    assert swap.state(key) in ("swapping_out", "on_host")
    swap.wait(key)
    assert alloc.stats().live_allocations == 0  # deallocated while on host
    assert swap.state(p) == "on_host"    # p still names it: no live allocation has p
    squatter = swap.allocate(n)          # may well be at p: the caching allocator reuses it
    if squatter == p:
        assert swap.state(p) == "resident"   # p now names the squatter
    assert swap.state(key) == "on_host"
    q = swap.swap_in(key, s)  # another stream: the caching allocator's pools are per stream
    assert q != squatter
    swap.wait(q, s)
    assert dev.read(q, n, s) == data
    st = swap.stats()
    assert st["relocations"] == (1 if q != p else 0) and st["relocating_swap_outs"] == 1
    if placement == "caching" and squatter == p:
        assert q != p
    assert swap.state(q) in ("resident", "swapping_in")
    with pytest.raises(vmalloc.InvalidPointerError):
        swap.state(key)                  # the key names nothing once swapped in
    swap.deallocate(q, s)
    swap.deallocate(squatter)
    dev.synchronize()
    assert alloc.stats().live_allocations == 0
    del swap
    dev.destroy_stream(s)


# --- deallocate in every state ---

def test_deallocate_in_every_state(make_dev):
    dev = make_dev(capacity="64MiB", granularity="2MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    s = dev.create_stream()
    ptrs = [va.allocate(3 * MiB) for _ in range(5)]
    small = va.allocate(100)
    for i, p in enumerate(ptrs):
        fill(dev, p, 3 * MiB, i)
    swap.swap_out(ptrs[1])
    swap.swap_out(ptrs[2])
    swap.wait(ptrs[2])
    swap.swap_out(ptrs[3])
    swap.wait(ptrs[3])
    swap.swap_in(ptrs[3])
    swap.swap_out(small)
    swap.wait(small)
    release = hold(dev, s)
    swap.swap_out(ptrs[4], s)  # in flight until released
    timer = release_later(release)
    try:
        assert swap.state(ptrs[4]) == "swapping_out"
        swap.deallocate(ptrs[4])  # waits for the copy
    finally:
        timer.join()
    for p in ptrs[:4] + [small]:
        swap.deallocate(p)
    dev.synchronize()
    swap.poll()
    st = swap.stats()
    assert (st["swapping_out"], st["on_host"], st["swapping_in"], st["host_bytes_in_use"]) == (0, 0, 0, 0)
    assert va.stats().live_allocations == 0
    va.release_cached()
    assert va.chunk_stats()["reservations"] == 0
    del swap
    dev.destroy_stream(s)
    if isinstance(dev, vmalloc.CudaDevice):
        from vmalloc import testing

        del va
        emu = testing.emulator()
        state = emu.device_state(dev.ordinal)
        held = {k: state[k] for k in testing.RESOURCE_FIELDS if k != "primary_context_refs"}
        assert not any(held.values()), emu.leak_report(dev.ordinal)


# --- sleep mode ---

@pytest.mark.parametrize("kind", ["virtual", "packed", "caching"])
def test_swap_out_all_and_swap_in_all(kind):
    dev = vmalloc.HostDevice(capacity="256MiB")
    alloc = {"virtual": lambda: vmalloc.VirtualAllocator(dev),
             "packed": lambda: vmalloc.VirtualAllocator(dev, placement="packed"),
             "caching": lambda: vmalloc.CachingAllocator(dev)}[kind]()
    swap = offload.SwapManager(alloc)
    sizes = [100, 5000, MiB + 1, 3 * MiB, 7 * MiB + 5]
    ptrs = [alloc.allocate(n) for n in sizes]
    datas = [fill(dev, p, n, i) for i, (p, n) in enumerate(zip(ptrs, sizes))]
    keys = swap.swap_out_all()
    assert sorted(keys) == sorted(ptrs)
    for p, n in zip(ptrs, sizes):
        # A relocating swap names the allocation by a host address from now on.
        assert (keys[p] == p) == (kind == "virtual" and n > alloc.small_threshold)
    assert swap.swap_out_all() == {}
    for p in ptrs:
        swap.wait(p)
        assert swap.state(p) == "on_host"
    assert alloc.stats().allocated_bytes == 0
    moved = swap.swap_in_all()
    assert sorted(moved) == sorted(keys.values())
    for p, n, data in zip(ptrs, sizes, datas):
        q = moved[keys[p]]
        if kind == "virtual" and n > alloc.small_threshold:
            assert q == p
        swap.wait(q)
        assert dev.read(q, n) == data
    for q in moved.values():
        swap.deallocate(q)
    assert alloc.stats().live_allocations == 0


# --- threads ---

def test_concurrent_swaps_from_threads():
    dev = vmalloc.HostDevice(capacity="128MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    errors = []

    def worker(seed):
        try:
            s = dev.create_stream()
            p = va.allocate(3 * MiB)
            data = fill(dev, p, 3 * MiB, seed)
            for _ in range(20):
                swap.swap_out(p, s)
                if seed % 2:
                    swap.wait(p, s)
                p = swap.swap_in(p, s)
                swap.wait(p, s)
            assert dev.read(p, 3 * MiB, s) == data
            swap.deallocate(p, s)
            dev.synchronize()
            dev.destroy_stream(s)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert va.stats().live_allocations == 0


def test_host_staging_pool_reuses_blocks_of_a_size_class():
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)
    p = va.allocate(5 * MiB)
    q = va.allocate(5 * MiB + 12345)  # the same 6 MiB class
    swap.swap_out(p)
    swap.wait(p)
    swap.swap_in(p)
    swap.wait(p)
    dev.synchronize()
    swap.poll()
    swap.swap_out(q)
    swap.wait(q)
    st = swap.stats()
    assert (st["host_alloc_calls"], st["host_reuses"], st["host_blocks_in_use"]) == (1, 1, 1)


def test_host_staging_pool_reuses_a_cached_block_up_to_twice_the_request():
    """Before: a cached 24 MiB block served only 24 MiB requests, so a 16 MiB swap-out pinned
    new pages (on an H200 host cuMemHostAlloc pinned ~1.4 GB/s: most of an out-of-core GPT-2
    step, whose activations change size by a few MiB between iterations)."""
    dev = vmalloc.HostDevice(capacity="128MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va)

    def round_trip(ptr):
        swap.swap_out(ptr)
        swap.wait(ptr)
        swap.swap_in(ptr)
        swap.wait(ptr)
        dev.synchronize()
        swap.poll()

    big, mid, small = va.allocate(24 * MiB), va.allocate(16 * MiB), va.allocate(4 * MiB)
    round_trip(big)                 # pins a 24 MiB block, then caches it
    round_trip(mid)                 # 16 MiB: served by the 24 MiB block (at most twice)
    round_trip(small)               # 4 MiB: the 24 MiB block is more than twice: pins anew
    st = swap.stats()
    assert (st["host_alloc_calls"], st["host_reuses"], st["host_blocks_cached"],
            st["host_bytes_cached"]) == (2, 1, 2, 28 * MiB)
    swap.swap_out(mid)
    swap.wait(mid)
    st = swap.stats()
    # In use counts the block's own class: the 24 MiB block holds the 16 MiB copy.
    assert (st["host_alloc_calls"], st["host_reuses"], st["host_bytes_in_use"]) == (
        2, 2, 24 * MiB)
    swap.swap_in(mid)
    swap.wait(mid)
    dev.synchronize()
    for p in (big, mid, small):
        va.deallocate(p)


def test_an_unbacked_device_is_refused():
    dev = vmalloc.HostDevice(backed=False)
    with pytest.raises(vmalloc.InvalidArgumentError, match="not backed"):
        offload.SwapManager(vmalloc.VirtualAllocator(dev))


def test_a_copy_queued_before_its_range_is_unmapped_faults_cleanly():
    # HostDevice validates every piece of a copy against the mapping table when it runs: a
    # range unmapped under a queued copy is a DeviceError at the next synchronization, never
    # a segfault on the stream's thread.
    dev = vmalloc.HostDevice(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    s = dev.create_stream(non_blocking=True)
    p = va.allocate(4 * MiB)
    fill(dev, p, 4 * MiB, 9)
    token = dev.hold_stream(s)
    dev.copy_device(p + MiB, p, 16, s)  # queued behind the hold
    va.unmap_backing(p, s, synchronize=False)  # the caller's promise broken on purpose
    dev.release_hold(token)
    with pytest.raises(vmalloc.DeviceError, match="not mapped"):
        dev.synchronize_stream(s)
    with pytest.raises(vmalloc.DeviceError, match="not mapped"):
        dev.read(p, 16)  # refused when queued
    va.map_backing(p)
    va.deallocate(p)
    dev.destroy_stream(s)


def test_a_logging_allocator_relocates_and_lists_its_allocations(tmp_path):
    dev = vmalloc.HostDevice(capacity="64MiB")
    with vmalloc.LoggingAllocator(vmalloc.VirtualAllocator(dev), tmp_path / "t.vmtrace") as log:
        swap = offload.SwapManager(log)
        p = log.allocate(3 * MiB)
        data = fill(dev, p, 3 * MiB, 10)
        assert swap.relocates(p)  # the adaptor cannot unmap in place
        assert len(swap.swap_out_all()) == 1
        swap.wait(p)
        q = swap.swap_in(p)
        swap.wait(q)
        assert dev.read(q, 3 * MiB) == data
        swap.deallocate(q)
        del swap
