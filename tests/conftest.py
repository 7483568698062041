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


#: name -> (attribute of vmalloc that must exist, factory(**options) -> Device).
#: Options understood by every factory: capacity, granularity (and backed for host).
DEVICE_KINDS = {
    "host": ("HostDevice", _host_device),
    "cuda-emulator": ("CudaDevice", _cuda_emulator_device),
}

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


@pytest.fixture(params=sorted(DEVICE_KINDS))
def make_device(request):
    """A factory of fresh devices of each kind: ``make_device(capacity=..., granularity=...)``."""
    return _available(DEVICE_KINDS, request.param)


@pytest.fixture(params=sorted(ALLOCATOR_KINDS))
def make_allocator(request):
    """A factory of allocators of each kind: ``make_allocator(device, **options)``."""
    return _available(ALLOCATOR_KINDS, request.param)
