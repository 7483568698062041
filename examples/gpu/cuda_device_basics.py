"""CudaDevice on a real GPU: the driver's virtual memory API under vmalloc's allocators.

Needs an NVIDIA GPU and driver (libcuda.so.1); not run in CI. The same code runs without a GPU
on the driver emulator: replace vmalloc.CudaDevice(0) by
vmalloc.testing.emulated_cuda_device() (see examples/driver_emulator_testing.py).

Run: python examples/gpu/cuda_device_basics.py
"""

import vmalloc

MiB = 1 << 20


def main():
    device = vmalloc.CudaDevice(0)
    print(f"{device.device_name}: {device.capacity / 2**30:.1f} GiB, granularity "
          f"{device.granularity // MiB} MiB, driver {device.driver_version}")
    allocator = vmalloc.VirtualAllocator(device)
    stream = device.create_stream()
    ptrs = [allocator.allocate(size * MiB, stream) for size in (3, 50, 7)]
    device.write(ptrs[1], b"on the GPU", stream=stream)
    print("read back:", device.read(ptrs[1], 10, stream=stream).decode())
    for ptr, size in zip(ptrs, (3, 50, 7)):
        allocator.deallocate(ptr, size * MiB, stream)
    again = allocator.allocate(50 * MiB, stream)  # served from the cache: no driver call
    allocator.deallocate(again, 50 * MiB, stream)
    device.synchronize_stream(stream)
    print("stats:", allocator.stats())
    print("driver calls:", {k: v for k, v in device.counters().items()
                            if k in ("create", "map", "set_access", "unmap", "release") and v})
    allocator.release_cached()
    del allocator
    device.destroy_stream(stream)


if __name__ == "__main__":
    main()
