"""The emulated device, HostDevice: the driver's virtual memory calls on host memory.

Shows real remapping (the same bytes at a new address), a rule the device enforces, streams
and events, an unbacked device holding 100 GiB on any machine, and the counters with their
modeled cost on a real GPU.

Run: python examples/host_device_basics.py
"""

import ctypes

import vmalloc

MiB = 1 << 20
GiB = 1 << 30


def remapping():
    dev = vmalloc.HostDevice(capacity="64MiB")
    chunk = dev.create("4MiB")                  # cuMemCreate: physical memory
    first = dev.reserve("16MiB")                # cuMemAddressReserve: address space
    second = dev.reserve("16MiB")
    dev.map(first, "4MiB", chunk)               # cuMemMap: mapped, not yet accessible
    dev.set_access(first, "4MiB")               # cuMemSetAccess
    dev.write(first + 100, b"same bytes, new address")
    dev.unmap(first, "4MiB")
    dev.map(second + 8 * MiB, "4MiB", chunk)    # the same physical chunk elsewhere
    try:
        dev.read(second + 8 * MiB + 100, 4)     # a new mapping starts inaccessible
    except vmalloc.DeviceError as error:
        print(f"refused: {error.call} -> {error.code_name}")
    dev.set_access(second + 8 * MiB, "4MiB")
    print("remapped:", dev.read(second + 8 * MiB + 100, 23).decode())

    try:
        dev.unmap(second + 8 * MiB, "2MiB")     # a sub-range of a mapping: not allowed
    except vmalloc.DeviceError as error:
        print(f"refused: {error}")
    print("state:", dev.state()["mappings"], "mapping,", dev.state()["bytes_created"] // MiB,
          "MiB created")
    c = dev.counters()
    print(f"calls: {c['memory_management_calls']} memory management calls, modeled "
          f"{c['modeled_seconds'] * 1e6:.1f} us on an A100")


def streams():
    dev = vmalloc.HostDevice()
    chunk = dev.create("2MiB")
    base = dev.reserve("2MiB")
    dev.map(base, "2MiB", chunk)
    dev.set_access(base, "2MiB")
    side = dev.create_stream()
    done = dev.create_event()
    pinned = dev.host_alloc(4096)               # pinned memory: copies are asynchronous
    ctypes.memmove(pinned, b"copied on a side stream", 23)
    dev.copy_to_device(base, pinned, 23, side)
    dev.record_event(done, side)
    dev.wait_event(0, done)                     # the default stream waits for the copy
    print("after the event:", dev.read(base, 23).decode())
    dev.host_free(pinned)
    dev.destroy_event(done)
    dev.destroy_stream(side)


def unbacked():
    dev = vmalloc.HostDevice(backed=False)      # books only: no memory behind
    chunk = 64 * MiB
    base = dev.reserve(100 * GiB)
    for i in range(100 * GiB // chunk):
        dev.map(base + i * chunk, chunk, dev.create(chunk))
    dev.set_access(base, 100 * GiB)
    s = dev.state()
    print(f"unbacked: {s['mappings']} mappings, {s['bytes_mapped'] // GiB} GiB mapped at "
          f"{base:#x}")


def main():
    remapping()
    streams()
    unbacked()


if __name__ == "__main__":
    main()
