"""Packed placement on the emulated device: tensors sharing chunks, the chunks held against
chunk placement, steal-first (with and without a remap slack) against create-first on a
repeated training step, and a replay of the built-in trace through both placements.

    python examples/packed_placement.py
"""

import vmalloc
from vmalloc import format_size
from vmalloc.replay import replay_once

MiB = 1 << 20
KiB = 1 << 10


def two_tensors():
    print("two 2.25 MiB tensors")
    for placement in ("chunks", "packed"):
        dev = vmalloc.HostDevice()
        va = vmalloc.VirtualAllocator(dev, placement=placement)
        a, b = va.allocate(9 * MiB // 4), va.allocate(9 * MiB // 4)
        dev.write(b, b"packed")
        assert dev.read(b, 6) == b"packed"
        s = va.stats()
        print(f"  {placement:<7} b right after a: {b == a + 9 * MiB // 4!s:<5}  reserved "
              f"{format_size(s.reserved_bytes):>8}  internal fragmentation "
              f"{format_size(s.internal_fragmentation_bytes)}")


def training_steps(steal_before_create, remap_slack=0.0):
    """Calls per step of a forward/backward pattern whose gradients outlive activations."""
    dev = vmalloc.HostDevice(backed=False)
    va = vmalloc.VirtualAllocator(dev, placement="packed",
                                  steal_before_create=steal_before_create,
                                  remap_slack=remap_slack)
    layers = [3 * MiB, 9 * MiB, 700 * KiB, 25 * MiB, 16 * KiB, 9 * MiB // 4] * 6
    calls = []
    for _ in range(4):
        before = dev.counters()["memory_management_calls"]
        acts = [va.allocate(n) for n in layers]
        grads = []
        for n, a in zip(reversed(layers), reversed(acts)):
            grads.append((va.allocate(n), n))
            va.deallocate(a, n)
        for g, n in grads:
            va.deallocate(g, n)
        calls.append(dev.counters()["memory_management_calls"] - before)
    s = va.stats()
    print(f"  steal_before_create={steal_before_create!s:<5} remap_slack={remap_slack:<6.4g} "
          f"driver calls per step {calls}"
          f"  utilization {s.peak_requested_bytes / s.peak_reserved_bytes:.3f}")
    return calls


def replay_builtin():
    print("built-in trace (vmalloc replay -a virtual,virtual-packed)")
    for kind in ("virtual", "virtual-packed"):
        r = replay_once(None, kind)
        print(f"  {kind:<15} peak requested {format_size(r.peak_requested_bytes):>10}  peak "
              f"reserved {format_size(r.peak_reserved_bytes):>10}  utilization "
              f"{r.utilization:.3f}")


def main():
    two_tensors()
    print("a training step repeated four times")
    assert training_steps(True)[-1] > 0        # the least held: some chunks move every step
    assert training_steps(True, 1 / 16)[-1] == 0  # 1/16 more held: settles
    assert training_steps(False)[-1] == 0       # create first: settles, most held
    replay_builtin()


if __name__ == "__main__":
    main()
