"""One rule for every allocator: allocating or freeing on a stream destroyed on the device is
refused with InvalidArgumentError, and changes nothing (the allocation can still be freed on a
live stream)."""

import pytest

import vmalloc

MiB = 1 << 20
KINDS = ["caching", "virtual", "virtual-packed", "logging"]


def make(kind, device, tmp_path):
    if kind == "caching":
        return vmalloc.CachingAllocator(device)
    if kind == "virtual":
        return vmalloc.VirtualAllocator(device)
    if kind == "virtual-packed":
        return vmalloc.VirtualAllocator(device, placement="packed")
    return vmalloc.LoggingAllocator(vmalloc.VirtualAllocator(device), tmp_path / "l.vmtrace")


@pytest.mark.parametrize("backed", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nbytes", [3 * MiB, 700])
def test_destroyed_stream_is_refused_for_alloc_and_free(kind, backed, nbytes, tmp_path):
    device = vmalloc.HostDevice(backed=backed)
    allocator = make(kind, device, tmp_path)
    s = device.create_stream()
    p = allocator.allocate(nbytes, stream=s)
    before = allocator.stats()
    device.destroy_stream(s)
    with pytest.raises(vmalloc.InvalidArgumentError, match="was destroyed"):
        allocator.deallocate(p, nbytes, stream=s)
    with pytest.raises(vmalloc.InvalidArgumentError, match="was destroyed"):
        allocator.allocate(nbytes, stream=s)
    after = allocator.stats()
    assert (after.allocated_bytes, after.reserved_bytes) == (before.allocated_bytes,
                                                             before.reserved_bytes)
    allocator.deallocate(p, nbytes, stream=0)  # still live: freed on a live stream
    q = allocator.allocate(nbytes, stream=0)
    allocator.deallocate(q, nbytes, stream=0)


def test_live_and_never_destroyed_streams_are_unaffected(tmp_path):
    device = vmalloc.HostDevice(backed=False)
    allocator = vmalloc.VirtualAllocator(device)
    a, b = device.create_stream(), device.create_stream()
    device.destroy_stream(a)
    for stream in (b, 0):  # a live stream, and the default stream
        p = allocator.allocate(MiB, stream=stream)
        assert p != 0 and allocator.allocation_size(p) == MiB
        assert allocator.stats().live_allocations == 1
        allocator.deallocate(p, MiB, stream=stream)
        assert allocator.stats().live_allocations == 0
    with pytest.raises(vmalloc.InvalidArgumentError, match="was destroyed"):
        allocator.allocate(MiB, stream=a)  # only the destroyed one is refused
