"""vmalloc's C ABI through ctypes, called the way PyTorch and CuPy call it, on the emulated
device (no GPU needed).

PyTorch's CUDAPluggableAllocator and CuPy's CFunctionAllocator load libvmalloc.so and call
these same functions; here ctypes plays their part, so you can see what they see.

Run: python examples/c_api_ctypes.py
"""

import ctypes

import vmalloc

MiB = 1 << 20


class Stats(ctypes.Structure):
    """struct vmalloc_stats: the fields of vmalloc.Stats, as uint64_t."""

    _fields_ = [(name, ctypes.c_uint64) for name in vmalloc.Stats.field_names()]


def load():
    lib = ctypes.CDLL(vmalloc.library_path())  # the very library vmalloc already loaded
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.vmalloc_torch_alloc.restype = vp
    lib.vmalloc_torch_alloc.argtypes = [ctypes.c_ssize_t, i, vp]
    lib.vmalloc_torch_free.restype = None
    lib.vmalloc_torch_free.argtypes = [vp, ctypes.c_ssize_t, i, vp]
    lib.vmalloc_cupy_malloc.restype = vp
    lib.vmalloc_cupy_malloc.argtypes = [vp, ctypes.c_size_t, i]
    lib.vmalloc_cupy_free.restype = None
    lib.vmalloc_cupy_free.argtypes = [vp, vp, i]
    lib.vmalloc_get_stats.argtypes = [i, ctypes.POINTER(Stats)]
    lib.vmalloc_last_error.restype = ctypes.c_char_p
    return lib


def main():
    device = vmalloc.HostDevice(capacity="256MiB", granularity="2MiB")
    allocator = vmalloc.VirtualAllocator(device, chunk_size="2MiB")
    vmalloc.set_current_allocator(allocator, device=0)  # device 0's requests go here
    lib = load()
    stream = device.create_stream()

    # PyTorch's signatures: alloc(size, device, stream), free(ptr, size, device, stream)
    tensors = [lib.vmalloc_torch_alloc(size, 0, stream) for size in (3 * MiB, 5 * MiB, 1000)]
    device.write(tensors[0], b"written through the C ABI")
    print("torch_alloc ->", [hex(p) for p in tensors])
    print("  read back:", device.read(tensors[0], 25).decode())

    # CuPy's signatures: malloc(param, size, device_id), free(param, ptr, device_id);
    # vmalloc's param is the stream, and CuPy hands it back at free
    array = lib.vmalloc_cupy_malloc(stream, 7 * MiB, 0)
    print("cupy_malloc ->", hex(array))

    stats = Stats()
    assert lib.vmalloc_get_stats(0, ctypes.byref(stats)) == 0
    print(f"stats through the ABI: requested {vmalloc.format_size(stats.requested_bytes)}, "
          f"reserved {vmalloc.format_size(stats.reserved_bytes)}, "
          f"live {stats.live_allocations}")
    assert stats.requested_bytes == allocator.stats().requested_bytes

    # failures return NULL and leave a message for this thread
    assert lib.vmalloc_torch_alloc(1 << 40, 0, stream) is None
    print("1 TiB on a 256 MiB device ->", lib.vmalloc_last_error().decode())
    assert lib.vmalloc_torch_alloc(4096, 3, None) is None
    print("device 3 ->", lib.vmalloc_last_error().decode())

    for p, size in zip(tensors, (3 * MiB, 5 * MiB, 1000)):
        lib.vmalloc_torch_free(p, size, 0, stream)
    lib.vmalloc_cupy_free(stream, array, 0)
    device.synchronize()
    device.destroy_stream(stream)
    final = allocator.stats()
    print(f"after the frees: live {final.live_allocations}, "
          f"peak requested {vmalloc.format_size(final.peak_requested_bytes)}, "
          f"out-of-memory failures {final.out_of_memory_count}")
    assert final.live_allocations == 0 and final.out_of_memory_count == 1
    vmalloc.set_current_allocator(None, device=0)


if __name__ == "__main__":
    main()
