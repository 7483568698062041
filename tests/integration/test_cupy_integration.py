"""vmalloc.cupy: CuPy memory from a vmalloc allocator through the C ABI, without a GPU.

CuPy imports on a machine without a GPU, and its CFunctionAllocatorMemory calls the C
functions without touching CUDA when the device is given; that is the path tested here.
Without CuPy installed only the import-safety tests run (the rest skip with the reason).
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vmalloc
import vmalloc.cupy


def _env():
    """The environment for a child Python: the vmalloc under test first on its path (absolute,
    so that a relative PYTHONPATH still works from the child's own cwd)."""
    env = dict(os.environ)
    package_root = str(Path(vmalloc.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env

MiB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpu" / "cupy_example.py"


def _cupy_or_skip():
    try:
        import cupy
        import cupy.cuda.memory  # noqa: F401
    except Exception as error:  # ImportError, or a broken CUDA runtime load
        pytest.skip(f"CuPy is not importable here ({type(error).__name__}: {error}); "
                    f"pip install cupy-cuda12x to run these tests")
    return cupy


@pytest.fixture
def cupy():
    return _cupy_or_skip()


@pytest.fixture
def allocator(make_allocator):
    a = make_allocator(vmalloc.HostDevice(capacity="64MiB", granularity="2MiB"))
    vmalloc._core.current_allocator.clear_last_error()  # failures are sticky per thread
    vmalloc.set_current_allocator(a, 0)
    yield a
    gc.collect()  # CuPy frees on garbage collection
    vmalloc.set_current_allocator(None, 0)


def test_import_and_use_without_cupy(monkeypatch, make_allocator):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    a = make_allocator(vmalloc.HostDevice(capacity="64MiB"))
    with pytest.raises(ImportError, match=r"vmalloc.cupy needs CuPy \(pip install cupy-cuda12x"):
        vmalloc.cupy.use_vmalloc(a)
    with pytest.raises(ImportError, match="vmalloc.cupy needs CuPy"):
        vmalloc.cupy.malloc(16, 0)
    assert vmalloc.get_current_allocator(0) is None  # nothing was changed


def test_import_in_a_fresh_interpreter_without_cupy(tmp_path):
    code = ("import sys; sys.modules['cupy'] = None; import vmalloc.cupy, vmalloc.torch; "
            "print('ok')")
    # run outside the repository, so that the installed (built) vmalloc is imported
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path,
                            env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_memory_pointer_from_the_allocator(cupy, allocator):
    mp = vmalloc.cupy.malloc(3000, device_id=0)
    assert isinstance(mp, cupy.cuda.MemoryPointer)
    assert mp.ptr != 0 and mp.device_id == 0 and mp.mem.size == 3000
    assert allocator.allocation_size(mp.ptr) == 3000
    stats = allocator.stats()
    assert (stats.requested_bytes, stats.live_allocations) == (3000, 1)
    # a view keeps the memory alive; dropping every reference frees it
    view = mp + 1000
    assert view.ptr == mp.ptr + 1000
    del mp
    gc.collect()
    assert allocator.stats().live_allocations == 1
    del view
    gc.collect()
    stats = allocator.stats()
    assert (stats.live_allocations, stats.total_deallocations) == (0, 1)
    assert vmalloc._core.current_allocator.last_error()[0] == 0


def test_the_stream_travels_to_the_allocator_and_back(cupy, allocator):
    device = allocator.device
    stream = device.create_stream()

    class FakeCupyStream:  # what CuPy streams look like: a .ptr CUstream
        ptr = stream

    try:
        mp = vmalloc.cupy.malloc(MiB, 0, FakeCupyStream())
        assert allocator.allocation_size(mp.ptr) == MiB
        device.write(mp.ptr, b"\x5a" * 64, stream=stream)
        assert device.read(mp.ptr, 64, stream=stream) == b"\x5a" * 64
        del mp
        gc.collect()
        assert allocator.stats().live_allocations == 0
        assert vmalloc._core.current_allocator.last_error()[0] == 0
    finally:
        device.synchronize()
        device.destroy_stream(stream)


def test_zero_size(cupy, allocator):
    mp = vmalloc.cupy.malloc(0, 0)
    assert mp.ptr == 0
    assert allocator.stats().total_allocations == 0


def test_out_of_memory_is_cupys_and_vmallocs(cupy, allocator):
    vmalloc._core.current_allocator.clear_last_error()
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        vmalloc.cupy.malloc(256 * MiB, 0)
    error = info.value
    assert isinstance(error, vmalloc.OutOfMemoryError)
    assert error.requested_bytes == 256 * MiB
    assert error.stats.out_of_memory_count == 1 and error.stats.live_allocations == 0
    assert str(error).startswith("vmalloc_cupy_malloc: ")
    assert allocator.stats().live_allocations == 0
    mp = vmalloc.cupy.malloc(MiB, 0)  # still usable
    assert allocator.allocation_size(mp.ptr) == MiB


def test_device_without_allocator(cupy, allocator):
    with pytest.raises(vmalloc.VmallocError, match="no current allocator for device 5"):
        vmalloc.cupy.malloc(4096, 5)
    with pytest.raises(vmalloc.InvalidArgumentError, match="size -1 is negative"):
        vmalloc.cupy.malloc(-1, 0)


def test_allocator_callable_reads_cupys_device_and_stream(cupy, allocator, monkeypatch):
    device = allocator.device
    stream = device.create_stream()

    class Current:
        ptr = stream

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Current())
    try:
        mp = vmalloc.cupy.VmallocCupyAllocator()(2 * MiB)
        assert allocator.allocation_size(mp.ptr) == 2 * MiB
        del mp
        gc.collect()
        assert allocator.stats().live_allocations == 0
    finally:
        device.synchronize()
        device.destroy_stream(stream)


def test_use_vmalloc_installs_and_restores(cupy, make_allocator):
    a = make_allocator(vmalloc.HostDevice(capacity="64MiB"))
    b = make_allocator(vmalloc.HostDevice(capacity="64MiB", ordinal=1))
    before = cupy.cuda.get_allocator()
    previous_device_1 = make_allocator(vmalloc.HostDevice(capacity="64MiB", ordinal=1))
    vmalloc.set_current_allocator(previous_device_1, 1)
    try:
        with vmalloc.cupy.use_vmalloc({0: a, 1: b}) as installed:
            assert isinstance(cupy.cuda.get_allocator(), vmalloc.cupy.VmallocCupyAllocator)
            assert vmalloc.get_current_allocator(0) is a
            assert vmalloc.get_current_allocator(1) is b
        assert cupy.cuda.get_allocator() == before
        assert vmalloc.get_current_allocator(0) is None
        assert vmalloc.get_current_allocator(1) is previous_device_1
        installed.restore()  # a second restore does nothing
        assert vmalloc.get_current_allocator(1) is previous_device_1
        # one allocator serves the device of its own ordinal
        handle = vmalloc.cupy.use_vmalloc(b)
        assert vmalloc.get_current_allocator(1) is b
        handle.restore()
        assert vmalloc.get_current_allocator(1) is previous_device_1
        with pytest.raises(TypeError, match="expected a vmalloc.Allocator"):
            vmalloc.cupy.use_vmalloc([a])
        assert cupy.cuda.get_allocator() == before
    finally:
        vmalloc.set_current_allocator(None, 1)


def _gpu_or_skip(cupy):
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:
        pytest.skip(f"no usable GPU for CuPy ({type(error).__name__}: {error})")
    if count == 0 or not hasattr(vmalloc, "CudaDevice"):
        pytest.skip("no GPU, or vmalloc.CudaDevice is not built")


def test_cupy_arrays_on_a_gpu(cupy):
    _gpu_or_skip(cupy)
    allocator = vmalloc.VirtualAllocator(vmalloc.CudaDevice(0))
    with vmalloc.cupy.use_vmalloc(allocator):
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        assert allocator.allocation_size(x.data.ptr) == x.nbytes
        assert float((x * 2).sum()) == float(2 * x.sum())
        del x
    gc.collect()
    assert allocator.stats().live_allocations == 0


def test_gpu_example_fails_fast_without_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path,
                            env=_env())
    if result.returncode == 0:  # a GPU machine: the example ran for real
        assert "utilization" in result.stdout
        return
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("cupy_example.py needs ")
    assert ("needs CuPy" in result.stderr) or ("needs an NVIDIA GPU" in result.stderr)
