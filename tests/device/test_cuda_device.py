"""CudaDevice over the driver emulator: the real driver code path, run without a GPU.

The device must behave as HostDevice does (the emulator enforces the same rules through the
driver's C interface), name the driver call and CUresult of every failure, keep the primary
context current around its calls from any thread, and leave nothing behind.
"""

import os
import subprocess
import sys
import threading
from ctypes import byref, c_void_p
from pathlib import Path

import pytest

import vmalloc
from vmalloc import CudaDevice, DeviceError, OutOfMemoryError, testing
from vmalloc.testing import driver_abi as abi

MiB = 1 << 20
G = 2 * MiB

INVALID_VALUE = 1
INVALID_DEVICE = 101
INVALID_HANDLE = 400
ILLEGAL_ADDRESS = 700


@pytest.fixture
def emu():
    return testing.emulator()


@pytest.fixture
def dev(emu):
    device = testing.emulated_cuda_device(capacity="64MiB", granularity="2MiB")
    ordinal = device.ordinal
    yield device
    emu.clear_faults()
    # Each test frees what it made (the device's destructor would, but must not need to).
    state = emu.device_state(ordinal)
    held = {k: state[k] for k in testing.RESOURCE_FIELDS if k != "primary_context_refs"}
    assert not any(held.values()), emu.leak_report(ordinal)


def mapped(dev, size=G):
    handle = dev.create(size)
    ptr = dev.reserve(2 * size)
    dev.map(ptr, size, handle)
    dev.set_access(ptr, size)
    return ptr, handle


def free_mapped(dev, ptr, handle, size=G):
    dev.unmap(ptr, size)
    dev.release(handle)
    dev.free_address(ptr, 2 * size)


# --- loading the driver ---------------------------------------------------------------------

def test_import_does_not_load_a_driver(tmp_path):
    code = ("import vmalloc; maps = open('/proc/self/maps').read(); "
            "print('libcuda' in maps)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(vmalloc.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


def test_missing_driver_is_a_clear_device_error(tmp_path):
    missing = str(tmp_path / "libcuda.so.1")
    with pytest.raises(DeviceError) as info:
        CudaDevice(library=missing)
    assert info.value.call == "dlopen"
    assert info.value.code == 100  # CUDA_ERROR_NO_DEVICE
    assert missing in str(info.value) and "VMALLOC_LIBCUDA" in str(info.value)


def test_library_without_the_entry_points():
    with pytest.raises(DeviceError) as info:
        CudaDevice(library="libm.so.6")
    assert info.value.call == "dlsym"
    assert info.value.code == 500  # CUDA_ERROR_NOT_FOUND
    assert "does not export cuInit" in str(info.value)


def test_default_library_follows_the_environment(monkeypatch):
    monkeypatch.setenv("VMALLOC_LIBCUDA", "/opt/somewhere/libcuda.so.1")
    assert CudaDevice.default_library() == "/opt/somewhere/libcuda.so.1"
    monkeypatch.delenv("VMALLOC_LIBCUDA")
    assert CudaDevice.default_library() == "libcuda.so.1"


# --- properties -----------------------------------------------------------------------------

def test_properties(dev, emu):
    assert dev.name == f"cuda:{dev.ordinal}"
    assert dev.granularity == G and dev.recommended_granularity == G
    assert dev.capacity == 64 * MiB
    assert dev.backed is True
    assert dev.physical_bytes_in_use == 0
    assert dev.library == testing.emulated_driver_path() == emu.path
    assert dev.driver_version == 12040
    assert dev.device_name == f"vmalloc emulated GPU {dev.ordinal}"
    assert isinstance(dev.context, int) and dev.context != 0
    assert emu.device_state(dev.ordinal)["primary_context_refs"] == 1


def test_granularity_comes_from_the_driver(emu):
    dev = testing.emulated_cuda_device(capacity="16MiB", granularity="64KiB")
    assert (dev.granularity, dev.capacity) == (64 * 1024, 16 * MiB)
    h = dev.create(64 * 1024)
    dev.release(h)


def test_bad_ordinal_retains_nothing(emu):
    before = [emu.device_state(i)["primary_context_refs"] for i in range(emu.device_count())]
    with pytest.raises(DeviceError) as info:
        CudaDevice(emu.device_count(), library=emu.path)
    assert (info.value.call, info.value.code) == ("cuDeviceGet", INVALID_DEVICE)
    assert "does not exist" in str(info.value)
    after = [emu.device_state(i)["primary_context_refs"] for i in range(emu.device_count())]
    assert after == before


def test_a_failure_during_construction_releases_the_context(emu):
    ordinal = testing.emulated_cuda_device().ordinal  # the device of a fresh ordinal, freed
    emu.set_fault("cuMemGetAllocationGranularity", 2, INVALID_VALUE)
    with pytest.raises(DeviceError) as info:
        CudaDevice(ordinal, library=emu.path)
    emu.clear_faults()
    assert info.value.call == "cuMemGetAllocationGranularity"
    assert "RECOMMENDED" in str(info.value) and "injected fault" in str(info.value)
    assert emu.idle(ordinal)


# --- the driver calls -----------------------------------------------------------------------



def test_errors_name_the_call_the_code_and_the_rule(dev):
    handle = dev.create(G)
    ptr = dev.reserve(4 * G)
    with pytest.raises(DeviceError) as info:
        dev.map(ptr, G // 2, handle)
    error = info.value
    assert (error.call, error.code, error.code_name) == ("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
    message = str(error)
    assert message.startswith(f"cuMemMap(ptr={ptr:#x}, size={G // 2}, offset=0, handle=")
    assert f"failed on {dev.name}: CUDA_ERROR_INVALID_VALUE (invalid argument)" in message
    assert "[driver emulator: cuMemMap on host:" in message
    assert "multiples of the granularity" in message
    # An unaligned address: CUDA_ERROR_NOT_SUPPORTED, as a real driver answers (H200, 580.159).
    with pytest.raises(DeviceError) as info:
        dev.map(ptr + 4096, G, handle)
    assert (info.value.call, info.value.code, info.value.code_name) == (
        "cuMemMap", 801, "CUDA_ERROR_NOT_SUPPORTED")
    dev.release(handle)
    dev.free_address(ptr, 4 * G)


def test_out_of_memory_raises_out_of_memory_error_and_recovers(dev):
    handles = [dev.create(16 * MiB) for _ in range(4)]
    with pytest.raises(OutOfMemoryError) as info:
        dev.create(G)
    assert info.value.requested_bytes == G
    assert "cuMemCreate(size=2097152) failed" in str(info.value)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)
    assert dev.physical_bytes_in_use == 64 * MiB
    dev.release(handles.pop())
    handles.append(dev.create(G))
    for h in handles:
        dev.release(h)


def test_what_the_driver_leaves_undefined_is_refused_before_calling_it(dev, emu):
    calls = {name: emu.call_count(name) for name in ("cuMemRelease", "cuStreamDestroy",
                                                     "cuEventDestroy", "cuMemFreeHost")}
    with pytest.raises(DeviceError, match="not a live physical allocation") as info:
        dev.release(12345)
    assert info.value.code == INVALID_VALUE
    handle = dev.create(G)
    dev.release(handle)
    with pytest.raises(DeviceError, match="already released"):
        dev.release(handle)
    with pytest.raises(DeviceError, match="not a stream created by this device") as info:
        dev.destroy_stream(0)
    assert info.value.code == INVALID_HANDLE
    with pytest.raises(DeviceError, match="not an event created by this device"):
        dev.destroy_event(0x1234)
    with pytest.raises(DeviceError, match="not pinned host memory allocated by this device"):
        dev.host_free(0x1000)
    calls["cuMemRelease"] += 1  # the one real release
    assert calls == {name: emu.call_count(name) for name in calls}



class FakeCupyStream:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeTorchStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_framework_streams_pass_straight_through(dev):
    ptr, handle = mapped(dev)
    stream = dev.create_stream()
    dev.write(ptr, b"cupy", stream=FakeCupyStream(stream))
    assert dev.read(ptr, 4, stream=FakeTorchStream(stream)) == b"cupy"
    dev.synchronize_stream(FakeCupyStream(stream))
    dev.destroy_stream(FakeTorchStream(stream))
    free_mapped(dev, ptr, handle)


def test_calls_from_any_thread_make_the_context_current_and_restore(dev, emu):
    cu = abi.bind(emu.lib)
    seen = {}

    def worker():
        current = c_void_p()
        cu.cuCtxGetCurrent(byref(current))
        seen["before"] = current.value
        ptr, handle = mapped(dev)  # this thread had no context: the device pushes its own
        dev.write(ptr, b"thread")
        seen["data"] = dev.read(ptr, 6)
        free_mapped(dev, ptr, handle)
        cu.cuCtxGetCurrent(byref(current))
        seen["after"] = current.value

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"before": None, "data": b"thread", "after": None}


def test_a_failing_context_push_fails_the_call_cleanly(dev, emu):
    before = emu.device_state(dev.ordinal)
    with emu.fault("cuCtxPushCurrent", code="CUDA_ERROR_INVALID_CONTEXT"):
        with pytest.raises(DeviceError) as info:
            dev.create(G)
    assert info.value.call == "cuCtxPushCurrent"
    assert emu.device_state(dev.ordinal) == before
    assert dev.physical_bytes_in_use == 0


def test_destroying_the_device_frees_what_it_still_owns(emu):
    dev = testing.emulated_cuda_device(capacity="64MiB")
    ordinal = dev.ordinal
    mapped(dev)
    dev.create(G)
    dev.reserve(G)
    dev.create_stream()
    dev.create_event()
    dev.host_alloc(4096)
    state = emu.device_state(ordinal)
    assert (state["handles"], state["reservations"], state["mappings"], state["streams"],
            state["events"], state["host_allocations"]) == (2, 2, 1, 1, 1, 1)
    del dev
    assert emu.leak_report(ordinal) == ""
    assert emu.idle(ordinal)


def test_two_devices(emu):
    a = testing.emulated_cuda_device(capacity="8MiB", devices=2)
    b = testing.emulated_cuda_device(capacity="16MiB")
    assert a.ordinal != b.ordinal
    assert (a.capacity, b.capacity) == (8 * MiB, 16 * MiB)
    assert (a.name, b.name) == (f"cuda:{a.ordinal}", f"cuda:{b.ordinal}")
    pa, ha = mapped(a)
    pb, hb = mapped(b)
    a.write(pa, b"on a")
    b.write(pb, b"on b")
    assert (a.read(pa, 4), b.read(pb, 4)) == (b"on a", b"on b")
    assert emu.device_state(a.ordinal)["bytes_created"] == G
    assert emu.device_state(b.ordinal)["bytes_created"] == G
    with pytest.raises(DeviceError) as info:
        a.map(pa + G, G, hb)  # b's handle is not a's
    assert info.value.code == 801  # CUDA_ERROR_NOT_SUPPORTED: not emulated across devices
    free_mapped(a, pa, ha)
    free_mapped(b, pb, hb)


def test_explicit_busy_ordinal_cannot_change_size(dev):
    same = testing.emulated_cuda_device(ordinal=dev.ordinal)  # shares the emulated GPU
    assert same.capacity == dev.capacity
    with pytest.raises(DeviceError, match="is in use"):
        testing.emulated_cuda_device(capacity="8MiB", ordinal=dev.ordinal)
    del same


# The behaviour every device shares (data, rules, capacity, streams, counters) is checked over
# HostDevice and this device alike in test_device_protocol.py.


# --- property: CudaDevice on the emulator and HostDevice answer every sequence alike --------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


class Lockstep:
    """One device and what a random sequence of calls created on it, by index."""

    def __init__(self, device):
        self.device = device
        self.handles = []        # [handle, size, released]
        self.reservations = []   # [base, size]
        self.mappings = []       # [ptr, size, handle index]

    def outcome(self, fn):
        try:
            return ("ok", fn())
        except DeviceError as e:
            return ("error", e.call, e.code)
        except OutOfMemoryError:
            return ("oom",)

    def apply(self, op, a, b, c):
        d = self.device
        if op == "create":
            size = [G, 2 * G, 3 * G, G + 4096, 0][a % 5]
            result = self.outcome(lambda: d.create(size))
            if result[0] == "ok":
                self.handles.append([result[1], size, False])
            return result[:1] if result[0] == "ok" else result
        if op == "reserve":
            size = [2 * G, 4 * G, 8 * G, 3 * 4096][a % 4]
            result = self.outcome(lambda: d.reserve(size))
            if result[0] == "ok":
                self.reservations.append([result[1], size])
            return result[:1] if result[0] == "ok" else result
        if op == "map" and self.reservations and self.handles:
            base, _ = self.reservations[a % len(self.reservations)]
            h = b % len(self.handles)
            handle, size, _ = self.handles[h]
            ptr = base + [0, G, 2 * G, 4096][c % 4]
            result = self.outcome(lambda: d.map(ptr, size, handle))
            if result[0] == "ok":
                self.mappings.append([ptr, size, h])
            return result
        if op == "unmap" and self.mappings:
            ptr, size, _ = self.mappings[a % len(self.mappings)]
            length = [size, G, 2 * size][b % 3]
            result = self.outcome(lambda: d.unmap(ptr, length))
            if result[0] == "ok":
                self.mappings = [m for m in self.mappings if not ptr <= m[0] < ptr + length]
            return result
        if op == "set_access" and self.reservations:
            base, size = self.reservations[a % len(self.reservations)]
            if self.mappings and b % 2:
                base, size, _ = self.mappings[b % len(self.mappings)]
            return self.outcome(lambda: d.set_access(base, size))
        if op == "release" and self.handles:
            entry = self.handles[a % len(self.handles)]
            result = self.outcome(lambda: d.release(entry[0]))
            if result[0] == "ok":
                entry[2] = True
            return result
        if op == "free" and self.reservations:
            i = a % len(self.reservations)
            base, size = self.reservations[i]
            result = self.outcome(lambda: d.free_address(base, size))
            if result[0] == "ok":
                del self.reservations[i]
            return result
        if op == "write_read" and self.mappings:
            ptr, _, _ = self.mappings[a % len(self.mappings)]
            data = bytes([a, b, c]) * 3
            return self.outcome(lambda: (d.write(ptr + 100, data), d.read(ptr + 100, 9))[1])
        return ("skip",)

    def cleanup(self):
        for ptr, size, _ in self.mappings:
            self.device.unmap(ptr, size)
        for handle, _, released in self.handles:
            if not released:
                self.device.release(handle)
        for base, size in self.reservations:
            self.device.free_address(base, size)


CALLS = st.lists(st.tuples(
    st.sampled_from(["create", "reserve", "map", "unmap", "set_access", "release", "free",
                     "write_read"]),
    st.integers(0, 11), st.integers(0, 11), st.integers(0, 11)), max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=CALLS)
def test_any_call_sequence_matches_host_device(calls):
    emu = testing.emulator()
    pair = [Lockstep(vmalloc.HostDevice(capacity="16MiB")),
            Lockstep(testing.emulated_cuda_device(capacity="16MiB"))]
    for call in calls:
        host, cuda = (side.apply(*call) for side in pair)
        assert host == cuda, call
    assert pair[0].device.physical_bytes_in_use == pair[1].device.physical_bytes_in_use
    for side in pair:
        side.cleanup()
    held = emu.device_state(pair[1].device.ordinal)
    assert held["handles"] == held["reservations"] == held["mappings"] == 0
