"""The SwapManager: a device too small for two models, each put to sleep on host in turn.

Two 24 MiB "models" share a 32 MiB emulated device. Each one is swapped out to pinned host
memory (vLLM's sleep mode) while the other runs; the VirtualAllocator keeps their pointers,
because their chunks are unmapped and remapped at the same addresses. A small tensor in the
allocator's arena relocates instead. Frees through the allocator (a framework's path) drop
what the manager held for them. Prints the states, the pointers and the counters.

Run: python examples/swap_manager.py
"""

import vmalloc
from vmalloc import offload

MiB = 1 << 20


def main():
    dev = vmalloc.HostDevice(capacity="32MiB")
    va = vmalloc.VirtualAllocator(dev)
    swap = offload.SwapManager(va, host_capacity="64MiB")

    a = va.allocate(24 * MiB)
    dev.write(a, b"weights of model A")
    swap.swap_out(a)                 # ordered after the work queued on stream 0
    print("A:", swap.state(a), "->", end=" ")
    swap.wait(a)                     # copy done, chunks back in the pool
    print(swap.state(a), f"(its {va.chunk_stats()['chunks_unbacked']} chunks are free)")

    b = va.allocate(24 * MiB)        # fits only because A's chunks were released
    dev.write(b, b"weights of model B")
    try:
        dev.read(a, 4)
    except vmalloc.DeviceError as error:
        print("reading A while it sleeps:", str(error).split(": ", 1)[1])

    swap.swap_out(b)                 # B to sleep: A's swap-in waits for B's memory
    a_again = swap.swap_in(a)
    swap.wait(a_again)
    print(f"A back at the same address: {a_again == a}; data:", dev.read(a, 18))

    small = va.allocate(1000)        # a small block shares an arena chunk: it relocates
    dev.write(small, b"tiny")
    print("a small block relocates:", swap.relocates(small))
    key = swap.swap_out(small)       # while out, a relocated allocation is known by a key
    swap.wait(key)
    small = swap.swap_in(key)
    swap.wait(small)
    print("small block data:", dev.read(small, 4))

    swap.deallocate(a)               # done with A: room for B again
    keys = swap.swap_out_all()       # {pointer: key}
    print(f"sleep mode: {len(keys)} more allocation(s) swapped out, "
          f"{swap.stats()['on_host'] + swap.stats()['swapping_out']} asleep")
    moved = swap.swap_in_all()       # {key: new}: B (asleep since earlier) and the small block
    for new in moved.values():
        swap.wait(new)
    small = moved[keys[small]]
    print("B data after waking up:", dev.read(b, 18))

    s = swap.stats()
    print(f"{s['swap_outs']} swap-outs ({s['bytes_swapped_out'] / MiB:.1f} MiB), "
          f"{s['swap_ins']} swap-ins, {s['cancelled_swap_outs']} cancelled, "
          f"{s['oom_retries']} waits for in-flight swap-outs, "
          f"peak pinned host memory {s['peak_host_bytes_in_use'] / MiB:.0f} MiB")
    # A framework frees through the allocator it was given, not the manager: a free of a
    # sleeping allocation still drops its record and its host copy at once.
    swap.swap_out(b)
    swap.wait(b)
    va.deallocate(b)                 # e.g. PyTorch's free callback on the VirtualAllocator
    print(f"B freed while asleep: {swap.stats()['on_host']} on host, "
          f"{swap.stats()['host_bytes_in_use']} bytes of pinned memory held")
    # Or hand the framework the manager itself: every free then goes through it.
    view = swap.as_allocator()       # a vmalloc.Allocator (set_current_allocator, use_vmalloc)
    view.deallocate(small)


if __name__ == "__main__":
    main()
