"""vmalloc.torch: PyTorch's pluggable allocator over the C ABI.

No CUDA PyTorch here: the wiring is tested against a stand-in of the few ``torch`` pieces
vmalloc.torch touches, which loads libvmalloc.so and calls the functions exactly as
PyTorch's CUDAPluggableAllocator does (ctypes.CDLL + function pointers). What CPU PyTorch
can show (clear errors, devices as torch.device) is tested on the real one when installed.
"""

import ctypes
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import vmalloc
import vmalloc.torch


def _env():
    """The environment for a child Python: the vmalloc under test first on its path (absolute,
    so that a relative PYTHONPATH still works from the child's own cwd)."""
    env = dict(os.environ)
    package_root = str(Path(vmalloc.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env

MiB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpu" / "torch_train_step.py"

ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
RECORD_STREAM = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
RESET = ctypes.CFUNCTYPE(None)


class FakeTorch:
    """The parts of ``torch`` that vmalloc.torch uses, behaving as PyTorch documents them:
    CUDAPluggableAllocator resolves the two names in the library at the path, hooks take
    function addresses, change_current_allocator refuses once CUDA is initialized."""

    def __init__(self):
        self.__version__ = "0.0-fake"
        self.version = types.SimpleNamespace(cuda="12.8")
        self._C = types.SimpleNamespace(_cuda_customAllocator=object())
        self.initialized = False
        self.installed = []
        self.cuda = types.SimpleNamespace(
            is_initialized=lambda: self.initialized,
            is_available=lambda: True,
            current_device=lambda: 0,
            memory=types.SimpleNamespace(CUDAPluggableAllocator=self._pluggable,
                                         change_current_allocator=self._change))

    def _pluggable(self, path, alloc_name, free_name):
        fake = self

        class Hooks:
            record_stream = reset = None

            def set_record_stream_fn(self, address):
                self.record_stream = RECORD_STREAM(address)

            def set_reset_fn(self, address):
                self.reset = RESET(address)

        class Pluggable:
            def __init__(self):
                library = ctypes.CDLL(path)
                self.path = path
                self.alloc = ALLOC(ctypes.cast(getattr(library, alloc_name), ctypes.c_void_p).value)
                self.free = FREE(ctypes.cast(getattr(library, free_name), ctypes.c_void_p).value)
                self.hooks = Hooks()
                self.fake = fake

            def allocator(self):
                return self.hooks

        return Pluggable()

    def _change(self, pluggable):
        if self.initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        self.installed.append(pluggable)


@pytest.fixture
def fake_torch(monkeypatch):
    fake = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(vmalloc.torch, "_pluggable", None)
    monkeypatch.setattr(vmalloc.torch, "_installed", False)
    yield fake


@pytest.fixture
def allocator(make_allocator):
    a = make_allocator(vmalloc.HostDevice(capacity="64MiB", granularity="2MiB"))
    vmalloc._core.current_allocator.clear_last_error()  # failures are sticky per thread
    yield a
    vmalloc.set_current_allocator(None, 0)
    vmalloc.set_current_allocator(None, 1)


def test_import_and_use_without_torch(monkeypatch, allocator):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"vmalloc.torch needs PyTorch \(pip install torch\)"):
        vmalloc.torch.use_vmalloc(allocator)
    with pytest.raises(ImportError, match="vmalloc.torch needs PyTorch"):
        vmalloc.torch.pluggable_allocator()
    assert vmalloc.get_current_allocator(0) is None
    # statistics need no torch
    vmalloc.set_current_allocator(allocator, 0)
    assert vmalloc.torch.memory_stats(0) == allocator.stats()
    assert vmalloc.torch.memory_stats() == allocator.stats()  # None: device 0 without torch


def test_use_vmalloc_installs_the_pluggable_allocator(fake_torch, allocator):
    vmalloc.torch.use_vmalloc(allocator)
    assert vmalloc.torch.is_installed()
    assert vmalloc.get_current_allocator(0) is allocator
    (pluggable,) = fake_torch.installed
    assert pluggable.path == vmalloc.library_path()
    # what PyTorch does for a CUDA tensor: alloc with (size, device, stream), free with the
    # allocation's size, device and stream
    p = pluggable.alloc(4096, 0, None)
    assert allocator.allocation_size(p) == 4096
    assert vmalloc.torch.memory_stats("cuda:0").requested_bytes == 4096
    pluggable.free(p, 4096, 0, None)
    assert vmalloc.torch.memory_stats(0).live_allocations == 0
    # the hooks: torch.cuda.empty_cache() and Tensor.record_stream
    p = pluggable.alloc(MiB, 0, None)
    pluggable.hooks.record_stream(p, None)
    pluggable.free(p, MiB, 0, None)
    assert allocator.stats().reserved_bytes > 0
    pluggable.hooks.reset()
    assert allocator.stats().reserved_bytes == 0
    assert vmalloc._core.current_allocator.last_error()[0] == 0


def test_later_calls_only_change_the_current_allocators(fake_torch, allocator, make_allocator):
    vmalloc.torch.use_vmalloc(allocator)
    (pluggable,) = fake_torch.installed
    p = pluggable.alloc(8192, 0, None)
    fake_torch.initialized = True  # CUDA runs now: PyTorch would refuse another swap
    other = make_allocator(vmalloc.HostDevice(capacity="64MiB"))
    second = make_allocator(vmalloc.HostDevice(capacity="64MiB", ordinal=1))
    vmalloc.torch.use_vmalloc({"cuda:0": other, 1: second})
    assert len(fake_torch.installed) == 1
    assert vmalloc.get_current_allocator(0) is other
    assert vmalloc.get_current_allocator(1) is second
    q = pluggable.alloc(4096, 1, None)
    assert second.allocation_size(q) == 4096
    pluggable.free(q, 4096, 1, None)
    pluggable.free(p, 8192, 0, None)  # goes back to the allocator that made it
    assert allocator.stats().live_allocations == 0
    assert other.stats().total_deallocations == 0


def test_refuses_once_cuda_is_initialized(fake_torch, allocator):
    fake_torch.initialized = True
    with pytest.raises(RuntimeError, match="already initialized CUDA and its own caching "
                                           "allocator"):
        vmalloc.torch.use_vmalloc(allocator)
    assert fake_torch.installed == [] and not vmalloc.torch.is_installed()
    assert vmalloc.get_current_allocator(0) is None


def test_a_refused_swap_restores_the_current_allocators(fake_torch, allocator):
    def refuse(pluggable):
        raise RuntimeError("Can't swap an already initialized allocator")

    fake_torch.cuda.memory.change_current_allocator = refuse
    with pytest.raises(RuntimeError, match=r"PyTorch refused to switch to the vmalloc allocator "
                                           r"\(Can't swap an already initialized allocator\)"):
        vmalloc.torch.use_vmalloc(allocator)
    assert vmalloc.get_current_allocator(0) is None and not vmalloc.torch.is_installed()


def test_bad_arguments(fake_torch, allocator):
    with pytest.raises(TypeError, match="expected a vmalloc.Allocator or a {device: Allocator}"):
        vmalloc.torch.use_vmalloc(None)
    with pytest.raises(TypeError, match="allocator for device 0 must be a vmalloc.Allocator"):
        vmalloc.torch.use_vmalloc({0: "caching"})
    with pytest.raises(ValueError, match="expected a CUDA device such as 'cuda:0', got 'cpu'"):
        vmalloc.torch.use_vmalloc({"cpu": allocator})
    assert fake_torch.installed == []
    with pytest.raises(vmalloc.VmallocError, match="device 3 has no current vmalloc allocator"):
        vmalloc.torch.memory_stats(3)


def test_memory_stats_and_out_of_memory_check(fake_torch, allocator):
    vmalloc.torch.use_vmalloc(allocator)
    (pluggable,) = fake_torch.installed
    p = pluggable.alloc(3 * MiB, 0, None)
    vmalloc.torch.reset_peak_memory_stats()
    assert vmalloc.torch.memory_stats().peak_requested_bytes == 3 * MiB
    vmalloc.torch.check_out_of_memory()  # nothing failed
    assert pluggable.alloc(1 << 40, 0, None) is None  # PyTorch gets a null pointer
    with pytest.raises(vmalloc.OutOfMemoryError, match="1 allocation.s. on device 0 ran out of "
                                                       "memory") as info:
        vmalloc.torch.check_out_of_memory(0)
    assert info.value.stats.out_of_memory_count == 1
    vmalloc.torch.check_out_of_memory(0)  # reported once
    pluggable.free(p, 3 * MiB, 0, None)


def _real_torch():
    try:
        import torch
    except ImportError as error:
        pytest.skip(f"PyTorch is not installed ({error})")
    return torch


def test_cpu_torch_gives_clear_errors(allocator):
    torch = _real_torch()
    if torch.version.cuda is not None:
        pytest.skip("this PyTorch has CUDA: tested by the GPU test")
    vmalloc.torch._pluggable = None
    with pytest.raises(RuntimeError, match=r"was built without CUDA \(torch.version.cuda is "
                                           r"None\); vmalloc.torch needs a CUDA build"):
        vmalloc.torch.use_vmalloc(allocator)
    assert vmalloc.get_current_allocator(0) is None
    # torch.device values name devices for the statistics
    vmalloc.set_current_allocator(allocator, 0)
    assert vmalloc.torch.memory_stats(torch.device("cuda", 0)) == allocator.stats()
    assert vmalloc.torch.memory_stats(torch.device("cuda")) == allocator.stats()
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        vmalloc.torch.memory_stats(torch.device("cpu"))


def test_cuda_torch_training_step_on_a_gpu(tmp_path):
    torch = _real_torch()
    if torch.version.cuda is None or not torch.cuda.is_available():
        pytest.skip(f"needs a GPU and a CUDA build of PyTorch (torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda})")
    # a fresh process: PyTorch's allocator swap is once per process
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path,
                            env=_env())
    assert result.returncode == 0, result.stderr
    assert "memory-management driver calls after warm-up: 0" in result.stdout


def test_gpu_example_fails_fast_without_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path,
                            env=_env())
    if result.returncode == 0:  # a GPU machine: the example ran for real
        assert "memory-management driver calls after warm-up: " in result.stdout
        return
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("torch_train_step.py needs ")
    assert ("needs PyTorch" in result.stderr) or ("needs an NVIDIA GPU" in result.stderr)
