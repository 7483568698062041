"""Chunk placement's steal_before_create: create first (the default) against steal first.

A step whose shapes shift (a 3-chunk tensor after two 2-chunk ones, one of them freed) runs
five times on the emulated device with each setting. Creating first holds more chunks and
makes no driver call after the first step; stealing first holds only what the step uses at
its peak and remaps chunks every step.

    python examples/chunk_steal_before_create.py
"""

import vmalloc

MC = 2 << 20  # the default chunk size


def step(va):
    a, b = va.allocate(2 * MC), va.allocate(2 * MC)
    va.deallocate(a)
    c = va.allocate(3 * MC)  # no cached range of 3 chunks: a miss, the first time at least
    va.deallocate(b)
    va.deallocate(c)


def run(steal_before_create):
    device = vmalloc.HostDevice(backed=False)  # unlimited: nothing forces stealing
    va = vmalloc.VirtualAllocator(device, steal_before_create=steal_before_create)
    calls = []
    for _ in range(5):
        before = device.counters()["memory_management_calls"]
        step(va)
        calls.append(device.counters()["memory_management_calls"] - before)
    c = va.chunk_stats()
    print(f"  steal_before_create={steal_before_create!s:<5}  memory-management calls per step "
          f"{calls}  peak chunks held {c['peak_chunks_held']}  stolen {c['chunks_stolen']}")
    return calls, c["peak_chunks_held"]


def main():
    print("a shifting step, five times:")
    create_calls, create_held = run(False)
    steal_calls, steal_held = run(True)
    assert create_calls[1:] == [0, 0, 0, 0] and create_held == 7
    assert all(n > 0 for n in steal_calls[1:]) and steal_held == 5
    print("create first (the default) keeps the steady state free of driver calls; steal first "
          "holds less")


if __name__ == "__main__":
    main()
