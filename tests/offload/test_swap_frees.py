"""Frees of swapped allocations (issue 15, defect 2): a free of an allocation that is on host
or has a copy in flight drops the swap record and the host copy at once, whichever way the
free goes (the manager's deallocate, the manager as an allocator, or straight through the
allocator, the path every framework's free callback takes); sleep, frees, wake restores the
rest; discard forgets without freeing; nothing leaks."""

import threading

import pytest

import vmalloc
from vmalloc import offload, testing

MiB = 1 << 20

# (allocator factory, size): chunk-owning (pointer-stable) and relocating allocations.
KINDS = {
    "virtual-chunks": (lambda d: vmalloc.VirtualAllocator(d), 3 * MiB),
    "virtual-small": (lambda d: vmalloc.VirtualAllocator(d), 1000),
    "packed": (lambda d: vmalloc.VirtualAllocator(d, placement="packed"), 3 * MiB),
    "caching": (lambda d: vmalloc.CachingAllocator(d), 3 * MiB),
    "expandable-segments": (lambda d: vmalloc.CachingAllocator(d, expandable_segments=True),
                            3 * MiB),
}


@pytest.fixture(params=["host", "cuda-emulator"])
def device(request):
    if request.param == "host":
        return vmalloc.HostDevice(capacity="64MiB")
    return testing.emulated_cuda_device(capacity="64MiB", granularity="2MiB")


def pattern(n, seed):
    return (bytes((seed * 31 + i) & 0xFF for i in range(256)) * (n // 256 + 1))[:n]


def hold(device, stream):
    """Blocks `stream` until the returned release() is called."""
    if isinstance(device, vmalloc.HostDevice):
        token = device.hold_stream(stream)
        return lambda: device.release_hold(token)
    emu = testing.emulator()
    token = emu.hold_stream(stream)
    return lambda: emu.release_hold(token)


def host_allocations(device):
    if isinstance(device, vmalloc.HostDevice):
        return device.state()["host_allocations"]
    return testing.emulator().device_state(device.ordinal)["host_allocations"]


def in_thread(call):
    """Runs call() in a thread; returns join() -> its exception or None."""
    box = []

    def run():
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            box.append(error)

    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join(timeout=30)
        assert not t.is_alive(), "the free never returned"
        return box[0] if box else None
    return join


def assert_forgotten(swap, alloc, ptr):
    s = swap.stats()
    assert (s["swapping_out"], s["on_host"], s["swapping_in"]) == (0, 0, 0)
    assert s["host_bytes_in_use"] == 0
    assert alloc.stats().live_allocations == 0
    with pytest.raises(vmalloc.InvalidPointerError):
        swap.state(ptr)


def assert_still_swaps(device, alloc, swap, size):
    """A new allocation swaps out and in with its data (when the allocator gives it the freed
    address -- which depends on where the OS maps each reservation -- this is the stale-record
    case; assert_forgotten checked already that no record names that address)."""
    q = alloc.allocate(size)
    data = pattern(size, 9)
    device.write(q, data)
    key = swap.swap_out(q)
    swap.wait(key)
    assert swap.state(key) == "on_host"
    q2 = swap.swap_in(key)
    swap.wait(q2)
    device.synchronize()
    swap.poll()
    assert swap.state(q2) == "resident"
    assert device.read(q2, size) == data
    alloc.deallocate(q2)
    return q


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_free_through_the_allocator_of_an_allocation_on_host_forgets_it(device, kind):
    make, size = KINDS[kind]
    alloc = make(device)
    swap = offload.SwapManager(alloc)
    p = alloc.allocate(size)
    device.write(p, pattern(size, 1))
    key = swap.swap_out(p)
    swap.wait(key)
    assert swap.state(p) == "on_host" and swap.stats()["host_bytes_in_use"] > 0
    alloc.deallocate(p)  # the framework's free callback: the allocator, not the manager
    assert_forgotten(swap, alloc, p)
    assert_still_swaps(device, alloc, swap, size)
    assert swap.release_cached_host() > 0
    del swap
    alloc.release_cached()
    assert host_allocations(device) == 0


@pytest.mark.parametrize("via", ["allocator", "manager", "as_allocator"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_free_while_the_swap_out_copy_is_in_flight_waits_and_forgets(device, kind, via):
    make, size = KINDS[kind]
    alloc = make(device)
    swap = offload.SwapManager(alloc)
    free = {"allocator": alloc.deallocate, "manager": swap.deallocate,
            "as_allocator": swap.as_allocator().deallocate}[via]
    p = alloc.allocate(size)
    device.write(p, pattern(size, 2))
    s = device.create_stream()
    release = hold(device, s)
    try:
        key = swap.swap_out(p, s)  # the copy waits behind the hold
        assert swap.state(key) == "swapping_out"
        join = in_thread(lambda: free(p))
    finally:
        release()
    assert join() is None
    assert_forgotten(swap, alloc, p)
    assert_still_swaps(device, alloc, swap, size)
    device.synchronize()
    del swap
    device.destroy_stream(s)


@pytest.mark.parametrize("via", ["allocator", "manager"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_free_while_the_swap_in_copy_is_in_flight_waits_and_forgets(device, kind, via):
    make, size = KINDS[kind]
    alloc = make(device)
    swap = offload.SwapManager(alloc)
    p = alloc.allocate(size)
    device.write(p, pattern(size, 3))
    key = swap.swap_out(p)
    swap.wait(key)
    s = device.create_stream()
    release = hold(device, s)
    try:
        q = swap.swap_in(key, s)  # the copy waits behind the hold
        assert swap.state(q) == "swapping_in"
        join = in_thread(lambda: (alloc if via == "allocator" else swap).deallocate(q))
    finally:
        release()
    assert join() is None
    assert_forgotten(swap, alloc, q)
    assert_still_swaps(device, alloc, swap, size)
    device.synchronize()
    del swap
    device.destroy_stream(s)


@pytest.mark.parametrize("kind", list(KINDS))
def test_sleep_then_frees_then_wake_restores_the_rest(device, kind):
    make, size = KINDS[kind]
    alloc = make(device)
    swap = offload.SwapManager(alloc)
    ptrs = [alloc.allocate(size) for _ in range(4)]
    data = {p: pattern(size, i) for i, p in enumerate(ptrs)}
    for p in ptrs:
        device.write(p, data[p])
    keys = swap.swap_out_all()  # sleep
    assert sorted(keys) == sorted(ptrs)
    for p in ptrs:
        swap.wait(keys[p])
    freed = ptrs[1:3]
    alloc.deallocate(freed[0])            # the framework's free, by its pointer
    swap.deallocate(keys[freed[1]])       # through the manager, by its name while out
    moved = swap.swap_in_all()            # wake
    kept = [ptrs[0], ptrs[3]]
    assert sorted(moved) == sorted(keys[p] for p in kept)
    for p in kept:
        q = moved[keys[p]]
        swap.wait(q)
        device.synchronize()
        assert device.read(q, size) == data[p]
    swap.poll()
    s = swap.stats()
    assert (s["on_host"], s["swapping_in"], s["host_bytes_in_use"]) == (0, 0, 0)
    assert alloc.stats().live_allocations == 2
    for p in kept:
        alloc.deallocate(moved[keys[p]])
    assert alloc.stats().live_allocations == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_discard_forgets_without_freeing(device, kind):
    make, size = KINDS[kind]
    alloc = make(device)
    swap = offload.SwapManager(alloc)
    p = alloc.allocate(size)
    device.write(p, pattern(size, 4))
    key = swap.swap_out(p)
    swap.wait(key)
    assert swap.discard(key) is True
    assert swap.stats()["host_bytes_in_use"] == 0
    assert swap.discard(key) is False  # nothing tracked: nothing changes
    if kind == "virtual-chunks":
        # Still live in the allocator, unbacked: its owner frees it there.
        assert alloc.stats().live_allocations == 1 and alloc.chunk_stats()["unbacked_ranges"] == 1
        alloc.deallocate(p)
    assert alloc.stats().live_allocations == 0
    # A resident allocation is not the manager's to forget.
    q = alloc.allocate(size)
    assert swap.discard(q) is False
    assert swap.state(q) == "resident"
    alloc.deallocate(q)


def test_discard_after_the_framework_freed_it_is_a_no_op(device):
    alloc = vmalloc.VirtualAllocator(device)
    swap = offload.SwapManager(alloc)
    p = alloc.allocate(3 * MiB)
    swap.swap_out(p)
    swap.wait(p)
    alloc.deallocate(p)  # forgotten here already
    assert swap.discard(p) is False
    assert swap.stats()["host_bytes_in_use"] == 0


def test_the_manager_as_an_allocator(device):
    alloc = vmalloc.VirtualAllocator(device)
    swap = offload.SwapManager(alloc)
    view = swap.as_allocator()
    assert isinstance(view, vmalloc.Allocator) and view.name == "swap"
    p = view.allocate(3 * MiB)
    small = view.allocate(1000)
    assert view.stats() == alloc.stats()
    assert view.allocation_size(p) == 3 * MiB
    device.write(small, pattern(1000, 5))
    key = swap.swap_out(small)  # relocates: named by a host address while out
    swap.wait(key)
    assert view.allocation_size(key) == 1000
    with pytest.raises(vmalloc.InvalidArgumentError, match="nbytes"):
        view.deallocate(key, 999)  # nothing changes
    assert swap.state(key) == "on_host"
    view.deallocate(key, 1000)
    view.deallocate(p, 3 * MiB)
    assert_forgotten(swap, alloc, key)
    del swap  # the view keeps the manager alive
    q = view.allocate(MiB)
    view.deallocate(q)


def test_a_manager_destroyed_stops_watching_the_allocator(device):
    alloc = vmalloc.VirtualAllocator(device)
    swap = offload.SwapManager(alloc)
    p = alloc.allocate(3 * MiB)
    swap.swap_out(p)
    swap.wait(p)
    del swap  # p stays live, unbacked, in the allocator
    assert alloc.chunk_stats()["unbacked_ranges"] == 1
    alloc.deallocate(p)
    assert alloc.stats().live_allocations == 0
