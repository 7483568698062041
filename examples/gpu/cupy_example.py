"""CuPy arrays whose memory comes from vmalloc's VirtualAllocator (needs an NVIDIA GPU).

Run: python examples/gpu/cupy_example.py
"""

import sys


def main():
    try:
        import cupy
    except ImportError as error:
        sys.exit(f"cupy_example.py needs CuPy (pip install cupy-cuda12x): {error}")
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, or a driver too old for this CuPy
        gpus, reason = 0, f"{type(error).__name__}: {error}"
    else:
        reason = "no CUDA device found"
    if gpus == 0:
        sys.exit(f"cupy_example.py needs an NVIDIA GPU: {reason}")

    import vmalloc
    import vmalloc.cupy

    allocator = vmalloc.VirtualAllocator(vmalloc.CudaDevice(0), chunk_size="2MiB")
    with vmalloc.cupy.use_vmalloc(allocator):
        # every CuPy allocation on device 0 now comes from `allocator`, freed on the
        # stream CuPy was using
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for step in range(5):
                a = cupy.random.rand(2048, 2048, dtype=cupy.float32)
                b = a @ a.T
                total = float(b.sum())
                del a, b
        stream.synchronize()
        print(f"last sum {total:.4g}")
    stats = allocator.stats()
    print(f"peak requested {vmalloc.format_size(stats.peak_requested_bytes)}, "
          f"peak reserved {vmalloc.format_size(stats.peak_reserved_bytes)}, "
          f"utilization {stats.utilization:.1%}")
    print("driver calls:", allocator.device.counters()["memory_management_calls"])


if __name__ == "__main__":
    main()
