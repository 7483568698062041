"""Testing vmalloc integrations without a GPU: the CUDA driver emulator.

vmalloc ships a strict stand-in for the CUDA driver (``libcuda.so.1``) built on the emulated
device. A :class:`vmalloc.CudaDevice` loaded on it runs the real driver code path on host
memory, and the emulator enforces the driver's virtual memory rules, reports leaks and injects
faults::

    from vmalloc import testing

    device = testing.emulated_cuda_device(capacity="1GiB")   # a vmalloc.CudaDevice
    allocator = vmalloc.VirtualAllocator(device)
    ...
    assert testing.emulator().leak_report(device.ordinal) == ""

See the "Testing without a GPU" page of the documentation.
"""

import gc

from vmalloc.testing._emulator import (
    RESOURCE_FIELDS,
    DriverEmulator,
    emulated_driver_path,
    emulator,
)
from vmalloc.testing._faults import FAULTABLE_CALLS, failure_code

__all__ = [
    "FAULTABLE_CALLS",
    "RESOURCE_FIELDS",
    "DriverEmulator",
    "emulated_cuda_device",
    "emulated_driver_path",
    "emulator",
    "failure_code",
]


def emulated_cuda_device(capacity=None, granularity=None, *, ordinal=None, devices=None):
    """A :class:`vmalloc.CudaDevice` running on the driver emulator.

    Args:
        capacity: the emulated GPU's memory (bytes or ``"16GiB"``); None = the emulator's
            default (``VMALLOC_EMULATOR_CAPACITY``, else 16 GiB).
        granularity: its allocation granularity; None = the default
            (``VMALLOC_EMULATOR_GRANULARITY``, else 2 MiB).
        ordinal: which emulated device; None (default) picks a fresh one: the first idle device
            (no live CudaDevice, nothing allocated), adding a device if none is idle, so
            devices left busy by other code never leak into a new one.
        devices: make the emulator expose at least this many devices.

    The device is (re)configured with ``capacity`` and ``granularity`` when it is idle;
    asking for an explicit busy ``ordinal`` with a different configuration raises
    :class:`vmalloc.DeviceError`.
    """
    from vmalloc import CudaDevice  # late: vmalloc imports nothing from here

    emu = emulator()
    if devices is not None:
        while emu.device_count() < int(devices):
            emu.add_device()
    wanted = {}
    if capacity is not None:
        wanted["capacity"] = capacity
    if granularity is not None:
        wanted["granularity"] = granularity
    if ordinal is None:
        ordinal = _fresh_device(emu)
    if ordinal >= emu.device_count():
        raise ValueError(f"ordinal {ordinal}: the emulator has {emu.device_count()} devices "
                         "(pass devices=... to add more)")
    if emu.idle(ordinal):
        # Always fresh: a device another test used starts over with the asked-for sizes.
        emu.configure_device(ordinal, capacity, granularity)
    elif wanted:
        state = emu.device_state(ordinal)
        from vmalloc.sizes import parse_size

        for key, value in wanted.items():
            if state[key] != parse_size(value):
                emu.configure_device(ordinal, capacity, granularity)  # raises: in use
    return CudaDevice(ordinal, library=emu.path)


def _fresh_device(emu):
    for attempt in range(2):
        for ordinal in range(emu.device_count()):
            if emu.idle(ordinal):
                return ordinal
        if attempt == 0:
            gc.collect()  # a CudaDevice in an unreachable cycle still holds its context
    return emu.add_device()

