"""VirtualAllocator basics on the emulated device: chunks mapped into contiguous ranges,
the cache, the small-block arena, stealing under pressure, and the statistics.

    python examples/virtual_allocator_basics.py
"""

import vmalloc
from vmalloc import format_size

MiB = 1 << 20


def show(title, va, device):
    s = va.stats()
    c = va.chunk_stats()
    print(f"{title}")
    print(f"  requested {format_size(s.requested_bytes):>11}  allocated "
          f"{format_size(s.allocated_bytes):>11}  reserved {format_size(s.reserved_bytes):>11}"
          f"  internal fragmentation {format_size(s.internal_fragmentation_bytes)}")
    print(f"  chunks: {c['chunks_live']} live, {c['chunks_cached']} cached in "
          f"{c['cached_ranges']} ranges, {c['chunks_in_arenas']} in arenas; "
          f"{c['reservations']} reservations; "
          f"{device.counters()['memory_management_calls']} memory-management driver calls")


def main():
    # A backed device: real memory, 32 MiB of it (16 chunks of 2 MiB).
    device = vmalloc.HostDevice(capacity="32MiB")
    va = vmalloc.VirtualAllocator(device)
    print(f"{va!r}\nchunk size {format_size(va.chunk_size)}, small requests up to "
          f"{format_size(va.small_threshold)} are sub-allocated\n")

    # 5 MiB needs 3 chunks: one reservation, 3 cuMemMap, one cuMemSetAccess.
    big = va.allocate(5 * MiB)
    device.write(big + 5 * MiB - 5, b"hello")  # one contiguous buffer
    small = [va.allocate(3000) for _ in range(100)]  # 100 blocks inside one chunk
    show("after 5 MiB and 100 x 3000 bytes:", va, device)
    assert device.read(big + 5 * MiB - 5, 5) == b"hello"

    # Freed memory stays mapped and is reused without a driver call.
    va.deallocate(big)
    calls = device.counters()["memory_management_calls"]
    for _ in range(1000):
        va.deallocate(va.allocate(5 * MiB))
    assert device.counters()["memory_management_calls"] == calls
    show("\nafter 1000 more allocate/deallocate pairs of 5 MiB:", va, device)

    # Fragment the address space: 12 one-chunk ranges, every other one freed.
    singles = [va.allocate(2 * MiB) for _ in range(12)]
    for p in singles[::2]:
        va.deallocate(p)
    show("\n12 single chunks allocated, 6 freed (scattered):", va, device)

    # 12 MiB needs 6 contiguous chunks: no cached range is that large and the device is
    # nearly full, so chunks are stolen from the cached ranges and remapped side by side.
    try:
        whole = va.allocate(12 * MiB)
    except vmalloc.OutOfMemoryError as e:
        print("unexpected:", e)
        raise
    device.write(whole, b"\x01" * (12 * MiB))
    show("\n12 MiB allocated from scattered free chunks:", va, device)
    print(f"  chunks stolen: {va.chunk_stats()['chunks_stolen']}")

    # Asking for more than is free raises OutOfMemoryError and changes nothing.
    try:
        va.allocate(64 * MiB)
    except vmalloc.OutOfMemoryError as e:
        print(f"\nOutOfMemoryError: {e}")

    for p in small + singles[1::2] + [whole]:
        va.deallocate(p)
    released = va.release_cached()
    print(f"\nrelease_cached() gave back {format_size(released)}; device holds "
          f"{format_size(device.physical_bytes_in_use)}")


if __name__ == "__main__":
    main()
