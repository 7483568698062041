"""Shared fixtures: the devices and allocators every allocator test suite runs over.

Add a device kind by adding an entry below, an allocator kind by adding it to
vmalloc.allocator_kinds; a kind whose class is not built yet is skipped, not failed, so suites
can land before every backend does.
"""

import os

# Checked mode of the emulated device: freed and relocated memory faults (docs/host_device.rst).
os.environ.setdefault("VMALLOC_CHECKED", "1")

import pytest
from hypothesis import settings

import vmalloc
import vmalloc.allocator_kinds

# CI (the CI variable set, as .ci/run does) draws the same hypothesis examples on every run, so
# a red CI means a regression, not an unlucky draw; elsewhere every run explores new examples.
# HYPOTHESIS_PROFILE=ci|dev chooses explicitly.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _host_device(**options):
    return vmalloc.HostDevice(**options)


def _cuda_emulator_device(**options):
    # The strict driver emulator stands in for libcuda.so.1 (see vmalloc.testing).
    from vmalloc import testing

    if not options.pop("backed", True):
        pytest.skip("the driver emulator always keeps real memory (backed=False is host-only)")
    return testing.emulated_cuda_device(**options)


# A real GPU, probed in a child process so that this process never initializes CUDA itself
# (the PyTorch tests need CUDA uninitialized) and only where a driver library is installed at
# all (no GPU: no child, nothing changes).
_PROBE = """
import ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
n = ctypes.c_int()
if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
    sys.exit(1)
paths = [p.split()[5] for p in open("/proc/self/maps") if len(p.split()) >= 6]
print(next(p for p in paths if p.rsplit("/", 1)[-1].startswith("libcuda.so")))
"""


def real_gpu_driver():
    """The path of the real CUDA driver library when it sees a GPU, else None
    (VMALLOC_TEST_NO_GPU=1 forces None)."""
    import ctypes.util
    import subprocess
    import sys

    if os.environ.get("VMALLOC_TEST_NO_GPU"):
        return None
    if ctypes.util.find_library("cuda") is None and not os.path.exists("/proc/driver/nvidia"):
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return probe.stdout.strip() or None if probe.returncode == 0 else None


REAL_GPU_DRIVER = real_gpu_driver()


def _cuda_gpu_device(**options):
    # The real GPU by the driver's full path: a bare "libcuda.so.1" would name the emulator
    # once it is loaded (same soname). The GPU's capacity is its memory: capacity= is not
    # enforced here, so tests that check the capacity itself fail on this kind (listed by
    # scripts/gpu-check); a granularity the GPU does not have skips.
    if not options.pop("backed", True):
        pytest.skip("a real GPU always keeps real memory (backed=False is host-only)")
    options.pop("capacity", None)
    granularity = options.pop("granularity", None)
    device = vmalloc.CudaDevice(0, library=REAL_GPU_DRIVER)
    if granularity is not None:
        from vmalloc.sizes import parse_size

        if parse_size(granularity) != device.granularity:
            pytest.skip(f"the GPU's granularity is {device.granularity}, not {granularity}")
    return device


#: name -> (attribute of vmalloc that must exist, factory(**options) -> Device).
#: Options understood by every factory: capacity, granularity (and backed for host).
#: "cuda" (a real CudaDevice) exists only where a GPU is present.
DEVICE_KINDS = {
    "host": ("HostDevice", _host_device),
    "cuda-emulator": ("CudaDevice", _cuda_emulator_device),
}
if REAL_GPU_DRIVER:
    DEVICE_KINDS["cuda"] = ("CudaDevice", _cuda_gpu_device)
# VMALLOC_TEST_DEVICE_KINDS=cuda (comma-separated names) runs the device suites on those kinds
# only: scripts/gpu-check runs them on the real GPU alone.
if os.environ.get("VMALLOC_TEST_DEVICE_KINDS"):
    _wanted = {k.strip() for k in os.environ["VMALLOC_TEST_DEVICE_KINDS"].split(",")}
    DEVICE_KINDS = {k: v for k, v in DEVICE_KINDS.items() if k in _wanted}

#: name -> (attribute of vmalloc that must exist, factory(device, **options) -> Allocator): the
#: package's one list of allocator kinds (vmalloc.allocator_kinds).
ALLOCATOR_KINDS = {kind.name: (kind.class_name, kind.make)
                   for kind in vmalloc.allocator_kinds.KINDS.values()}


def _available(kinds, name):
    attribute, factory = kinds[name]
    if not hasattr(vmalloc, attribute):
        pytest.skip(f"vmalloc.{attribute} is not built")
    if name == "cuda-emulator":
        try:
            from vmalloc import testing  # noqa: F401

            if not hasattr(testing, "emulated_cuda_device"):
                pytest.skip("vmalloc.testing.emulated_cuda_device is not built")
        except ImportError:
            pytest.skip("vmalloc.testing is not built")
    return factory


@pytest.fixture
def emu():
    """The driver emulator (vmalloc.testing), with no fault set on entry nor left on exit."""
    from vmalloc import testing

    emulator = testing.emulator()
    emulator.clear_faults()
    yield emulator
    emulator.clear_faults()


@pytest.fixture(params=sorted(DEVICE_KINDS))
def make_device(request):
    """A factory of fresh devices of each kind: ``make_device(capacity=..., granularity=...)``."""
    if request.param == "cuda" and any(word in request.node.name
                                       for word in ("capacity", "out_of_memory")):
        pytest.skip("a real GPU's capacity is its memory: this test needs a set capacity")
    return _available(DEVICE_KINDS, request.param)


@pytest.fixture(params=sorted(ALLOCATOR_KINDS))
def make_allocator(request):
    """A factory of allocators of each kind: ``make_allocator(device, **options)``."""
    return _available(ALLOCATOR_KINDS, request.param)
