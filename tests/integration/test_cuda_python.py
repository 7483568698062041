"""cuda-python on the driver emulator: cuda.bindings.driver resolves its functions through the
emulator's cuGetProcAddress_v2, and a cuda.core program allocates through vmalloc
(vmalloc.cuda_core.VmallocMemoryResource). cuda-bindings dlopen()s "libcuda.so.1", so each
program runs in a subprocess with LD_LIBRARY_PATH pointing at the emulator."""

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import vmalloc

testing = pytest.importorskip("vmalloc.testing")
pytest.importorskip("cuda.bindings.driver",
                    reason="cuda-bindings is not installed (pip install 'vmalloc[cuda]')")


def run_on_emulator(code):
    library = Path(testing.emulated_driver_path())
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(library.parent)] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env["VMALLOC_LIBCUDA"] = str(library)
    env.pop("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", None)
    # Not from the repository root, where "import vmalloc" would find the unbuilt sources.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(vmalloc.__file__).parent.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=120,
                            cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()


def test_cuda_bindings_driver_calls_run_on_the_emulator():
    out = run_on_emulator("""
        from cuda.bindings import driver as d
        ok = d.CUresult.CUDA_SUCCESS
        assert d.cuInit(0)[0] == ok
        err, version = d.cuDriverGetVersion(); assert err == ok
        err, count = d.cuDeviceGetCount(); assert err == ok
        err, dev = d.cuDeviceGet(0); assert err == ok
        err, total = d.cuDeviceTotalMem(dev); assert err == ok
        err, ctx = d.cuDevicePrimaryCtxRetain(dev); assert err == ok
        assert d.cuCtxSetCurrent(ctx)[0] == ok
        # The VMM calls, as vmalloc's CudaDevice makes them.
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        err, gran = d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        assert err == ok
        err, handle = d.cuMemCreate(gran, prop, 0); assert err == ok
        err, ptr = d.cuMemAddressReserve(gran, 0, 0, 0); assert err == ok
        assert d.cuMemMap(ptr, gran, 0, handle, 0)[0] == ok
        assert d.cuMemUnmap(ptr, gran)[0] == ok
        assert d.cuMemAddressFree(ptr, gran)[0] == ok
        assert d.cuMemRelease(handle)[0] == ok
        assert d.cuDevicePrimaryCtxRelease(dev)[0] == ok
        # Strict: what the emulator does not implement is not found.
        try:
            d.cuMemGetInfo()
            print("found")
        except Exception as e:
            print(type(e).__name__)
        print(version, count, total, gran)
    """)
    assert out == ["FunctionNotFoundError", "12040", "1", str(16 << 30), str(2 << 20)]


def test_cu_get_proc_address_is_strict():
    out = run_on_emulator("""
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_int)]
        pfn, status = ctypes.c_void_p(), ctypes.c_int(-1)
        def ask(name, version=12040, flags=0):
            pfn.value = None
            status.value = -1
            r = get(name.encode(), ctypes.byref(pfn), version, flags, ctypes.byref(status))
            return r, status.value, pfn.value
        def addr(symbol):
            return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        r, s, p = ask("cuMemMap"); print(r, s, p == addr("cuMemMap"))
        r, s, p = ask("cuStreamDestroy"); print(r, s, p == addr("cuStreamDestroy_v2"))
        r, s, p = ask("cuGetProcAddress"); print(r, s, p == addr("cuGetProcAddress_v2"))
        print(*ask("cuMemGetInfo")[:2], ask("cuMemGetInfo")[2] is None)  # not implemented
        print(*ask("cuStreamDestroy", version=3020)[:2])  # only the _v2 (CUDA 4.0) exists
        print(ask("cuMemMap", flags=2)[0], ask("cuMemMap", flags=8)[0])  # PTDS, bad flags
        print(lib.cuGetProcAddress_v2(None, ctypes.byref(pfn), 12040, 0, None))
    """)
    assert out == ["0", "0", "True", "0", "0", "True", "0", "0", "True",
                   "500", "1", "True", "500", "2", "801", "1", "1"]


def test_cuda_core_program_allocates_through_vmalloc():
    pytest.importorskip("cuda.core", reason="cuda-core is not installed (pip install "
                        "'vmalloc[cuda]'; needs Python >= 3.10)")
    out = run_on_emulator("""
        import vmalloc
        from vmalloc import testing
        from cuda.core import Device, MemoryResource, Stream
        from vmalloc.cuda_core import VmallocMemoryResource

        dev = Device(0)
        dev.set_current()
        allocator = vmalloc.VirtualAllocator(testing.emulated_cuda_device(ordinal=0))
        mr = VmallocMemoryResource(allocator)
        assert isinstance(mr, MemoryResource)
        print(mr.is_device_accessible, mr.is_host_accessible, mr.device_id)
        buf = mr.allocate(3 << 20, stream=dev.default_stream)
        print(buf.size, buf.memory_resource is mr, allocator.allocation_size(int(buf.handle)))
        print(allocator.stats().requested_bytes)
        buf.close()
        print(allocator.stats().requested_bytes)
        # A stream of the program's own, handed to cuda.core by handle.
        s = allocator.device.create_stream()
        stream = Stream.from_handle(s)
        b = mr.allocate(1 << 20, stream=stream)
        print(allocator.stats().live_allocations)
        b.close()
        allocator.device.synchronize()
        print(allocator.stats().live_allocations)
    """)
    assert out == ["True", "False", "0", str(3 << 20), "True", str(3 << 20), str(3 << 20),
                   "0", "1", "0"]
