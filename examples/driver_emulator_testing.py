"""Testing a vmalloc integration without a GPU: CudaDevice on the CUDA driver emulator.

The emulator is a stand-in libcuda.so.1 shipped with vmalloc. A vmalloc.CudaDevice on it runs
the real driver code path on host memory, while the emulator enforces the driver's rules,
injects faults on request and reports leaks. This is what a downstream project's CI can do.

Run: python examples/driver_emulator_testing.py
"""

import vmalloc
from vmalloc import testing

MiB = 1 << 20


def main():
    emu = testing.emulator()
    device = testing.emulated_cuda_device(capacity="64MiB")
    print(f"{device!r} on {device.device_name}, driver API {device.driver_version}")

    allocator = vmalloc.VirtualAllocator(device)
    ptr = allocator.allocate(5 * MiB)
    message = b"hello through cuMemcpyHtoDAsync_v2"
    device.write(ptr, message)
    print("read back:", device.read(ptr, len(message)).decode())

    # A broken rule: the driver's error code, and the emulator says which rule.
    try:
        device.map(ptr + 4096, 2 * MiB, 12345)
    except vmalloc.DeviceError as error:
        print(f"refused: {error.call} -> {error.code_name}")

    # Fault injection: the next cuMemCreate fails as on a full GPU.
    with emu.fault("cuMemCreate", nth=1, code="CUDA_ERROR_OUT_OF_MEMORY", count=0):
        try:
            allocator.allocate(40 * MiB)
        except vmalloc.OutOfMemoryError:
            print("injected out-of-memory raised OutOfMemoryError; accounting unchanged:",
                  allocator.stats().live_allocations == 1)

    allocator.deallocate(ptr, 5 * MiB)
    allocator.release_cached()
    del allocator
    # Leak check: after the allocator is gone the emulated GPU must hold nothing.
    state = emu.device_state(device.ordinal)
    leaked = {k: v for k, v in state.items()
              if k in testing.RESOURCE_FIELDS and k != "primary_context_refs" and v}
    print("leaked:", leaked or "nothing")
    assert not leaked, emu.leak_report(device.ordinal)
    print("driver calls:", {k: v for k, v in device.counters().items()
                            if k in ("create", "map", "set_access", "unmap", "release") and v})


if __name__ == "__main__":
    main()
