"""The driver emulator (vmalloc/testing/libcuda.so.1) called directly through its C ABI.

Every rule the emulator enforces is broken once: the call returns the documented CUresult,
says why (vmallocEmulatorLastError), and changes nothing. Plus contexts, several devices, the
leak report, fault injection and the environment variables (in subprocesses, since they are
read when the library loads).
"""

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from ctypes import byref, c_char_p, c_int, c_size_t, c_ulonglong, c_void_p
from pathlib import Path

import pytest

import vmalloc
from vmalloc import testing
from vmalloc.testing import driver_abi as abi

MiB = 1 << 20
GRANULARITY = 2 * MiB
PAGE = os.sysconf("SC_PAGE_SIZE")


class Session:
    """One emulated device with its primary context current on this thread, and the
    resources a test created on it (freed by cleanup())."""

    def __init__(self, emu, cu, ordinal):
        self.emu, self.cu, self.ordinal = emu, cu, ordinal
        self.prop = abi.allocation_prop(ordinal)
        self.handles, self.reservations, self.mappings = [], [], []

    def ok(self, result):
        assert result == 0, f"{vmalloc.errors.cu_result_name(result)}: {self.emu.last_error()}"

    def state(self):
        return self.emu.device_state(self.ordinal)

    def create(self, size=GRANULARITY):
        h = c_ulonglong()
        self.ok(self.cu.cuMemCreate(byref(h), size, byref(self.prop), 0))
        self.handles.append(h.value)
        return h.value

    def reserve(self, size=4 * GRANULARITY, alignment=0):
        p = c_ulonglong()
        self.ok(self.cu.cuMemAddressReserve(byref(p), size, alignment, 0, 0))
        self.reservations.append((p.value, size))
        return p.value

    def map(self, ptr, size, handle):
        self.ok(self.cu.cuMemMap(ptr, size, 0, handle, 0))
        self.mappings.append((ptr, size))

    def set_access(self, ptr, size):
        desc = abi.access_desc(self.ordinal)
        self.ok(self.cu.cuMemSetAccess(ptr, size, byref(desc), 1))

    def unmap(self, ptr, size):
        self.ok(self.cu.cuMemUnmap(ptr, size))
        self.mappings.remove((ptr, size))

    def release(self, handle):
        self.ok(self.cu.cuMemRelease(handle))
        self.handles.remove(handle)

    def mapped(self, size=GRANULARITY, access=True):
        """A reservation of 2*size with one allocation of `size` mapped at its start."""
        ptr = self.reserve(2 * size)
        handle = self.create(size)
        self.map(ptr, size, handle)
        if access:
            self.set_access(ptr, size)
        return ptr, handle

    def write(self, ptr, data):
        buf = ctypes.create_string_buffer(data, len(data))
        self.ok(self.cu.cuMemcpyHtoDAsync(ptr, buf, len(data), None))
        self.ok(self.cu.cuStreamSynchronize(None))

    def read(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        self.ok(self.cu.cuMemcpyDtoHAsync(buf, ptr, n, None))
        self.ok(self.cu.cuStreamSynchronize(None))
        return buf.raw

    def cleanup(self):
        for ptr, size in list(self.mappings):
            self.unmap(ptr, size)
        for handle in list(self.handles):
            self.release(handle)
        for ptr, size in self.reservations:
            self.ok(self.cu.cuMemAddressFree(ptr, size))
        self.reservations.clear()


def idle_ordinal(emu):
    for ordinal in range(emu.device_count()):
        if emu.idle(ordinal):
            return ordinal
    return emu.add_device()


@pytest.fixture
def emu():
    return testing.emulator()


@pytest.fixture
def cu(emu):
    lib = abi.bind(emu.lib)
    assert lib.cuInit(0) == 0
    return lib


@pytest.fixture
def drv(emu, cu):
    ordinal = idle_ordinal(emu)
    emu.configure_device(ordinal, capacity=64 * MiB, granularity=GRANULARITY)
    ctx = c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(byref(ctx), ordinal) == 0
    assert cu.cuCtxPushCurrent(ctx) == 0
    session = Session(emu, cu, ordinal)
    session.context = ctx.value
    yield session
    emu.clear_faults()
    session.cleanup()
    popped = c_void_p()
    assert cu.cuCtxPopCurrent(byref(popped)) == 0 and popped.value == ctx.value
    assert cu.cuDevicePrimaryCtxRelease(ordinal) == 0
    assert emu.leak_report(ordinal) == ""


def run_python(code, env=None, expect_returncode=0):
    """Runs `code` in a fresh interpreter (the emulator reads its environment at load)."""
    full_env = dict(os.environ)
    full_env.pop("VMALLOC_LIBCUDA", None)
    for key in list(full_env):
        if key.startswith("VMALLOC_EMULATOR_"):
            del full_env[key]
    full_env.update(env or {})
    # The same vmalloc as this process, whatever the working directory.
    package_root = str(Path(vmalloc.__file__).parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    prelude = textwrap.dedent("""
        import ctypes
        from ctypes import byref, c_int, c_size_t, c_ulonglong, c_void_p, c_char_p
        from vmalloc import testing
        from vmalloc.testing import driver_abi as abi
        emu = testing.emulator()
        cu = abi.bind(emu.lib)
    """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          env=full_env, capture_output=True, text=True, timeout=60,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == expect_returncode, proc.stderr
    return proc


# ---------------------------------------------------------------------------------------------
# The C ABI itself.

def test_exports_exactly_the_versioned_entry_points_cuda_device_uses(emu):
    symbols = vmalloc.CudaDevice.driver_entry_points()
    assert symbols == [symbol for symbol, _ in abi.ENTRY_POINTS.values()]
    for symbol in symbols:
        assert hasattr(emu.lib, symbol), symbol
    # cuda.h maps these to _v2; the unversioned symbols are the legacy (CUDA 3.x) ABI, which
    # the emulator does not export so that nothing can call them by mistake.
    for legacy in ("cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync",
                   "cuStreamDestroy", "cuEventDestroy", "cuCtxPushCurrent", "cuCtxPopCurrent",
                   "cuDeviceTotalMem", "cuDevicePrimaryCtxRelease"):
        assert not hasattr(emu.lib, legacy), legacy
    assert "cuMemcpyHtoDAsync_v2" in symbols and "cuMemHostAlloc" in symbols
    # The vmalloc core compiled into the emulator stays private.
    for private in ("vmalloc_allocate", "vmalloc_torch_alloc", "vmalloc_cupy_malloc"):
        assert not hasattr(emu.lib, private), private


def test_error_names_and_strings(cu, emu):
    text = c_char_p()
    assert cu.cuGetErrorName(1, byref(text)) == 0 and text.value == b"CUDA_ERROR_INVALID_VALUE"
    assert cu.cuGetErrorString(2, byref(text)) == 0 and text.value == b"out of memory"
    assert cu.cuGetErrorName(700, byref(text)) == 0
    assert text.value == b"CUDA_ERROR_ILLEGAL_ADDRESS"
    assert cu.cuGetErrorName(12345, byref(text)) == abi.CUDA_ERROR_INVALID_VALUE
    assert text.value is None
    version = c_int()
    assert cu.cuDriverGetVersion(byref(version)) == 0 and version.value == 12040


def test_device_queries(drv, cu):
    count, device, total = c_int(), c_int(), c_size_t()
    assert cu.cuDeviceGetCount(byref(count)) == 0 and count.value > drv.ordinal
    assert cu.cuDeviceGet(byref(device), drv.ordinal) == 0 and device.value == drv.ordinal
    assert cu.cuDeviceTotalMem(byref(total), drv.ordinal) == 0 and total.value == 64 * MiB
    name = ctypes.create_string_buffer(64)
    assert cu.cuDeviceGetName(name, 64, drv.ordinal) == 0
    assert name.value == f"vmalloc emulated GPU {drv.ordinal}".encode()
    g = c_size_t()
    assert cu.cuMemGetAllocationGranularity(byref(g), byref(drv.prop),
                                            abi.CU_MEM_ALLOC_GRANULARITY_MINIMUM) == 0
    assert g.value == GRANULARITY
    assert cu.cuMemGetAllocationGranularity(byref(g), byref(drv.prop),
                                            abi.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == 0
    assert g.value == GRANULARITY
    assert cu.cuMemGetAllocationGranularity(byref(g), byref(drv.prop), 7) == 1
    assert "option is 7" in drv.emu.last_error()


def test_bad_ordinal_is_invalid_device(drv, cu, emu):
    bad = emu.device_count()
    device, ctx, total = c_int(), c_void_p(), c_size_t()
    assert cu.cuDeviceGet(byref(device), bad) == abi.CUDA_ERROR_INVALID_DEVICE
    assert f"device {bad} does not exist" in emu.last_error()
    assert cu.cuDeviceGet(byref(device), -1) == abi.CUDA_ERROR_INVALID_DEVICE
    assert cu.cuDevicePrimaryCtxRetain(byref(ctx), bad) == abi.CUDA_ERROR_INVALID_DEVICE
    assert cu.cuDeviceTotalMem(byref(total), bad) == abi.CUDA_ERROR_INVALID_DEVICE
    prop = abi.allocation_prop(bad)
    h = c_ulonglong()
    before = drv.state()
    assert cu.cuMemCreate(byref(h), GRANULARITY, byref(prop), 0) == abi.CUDA_ERROR_INVALID_DEVICE
    assert drv.state() == before


# ---------------------------------------------------------------------------------------------
# Every enforced rule, broken once: code, message, nothing changed.

def _create_with(drv, size=GRANULARITY, flags=0, **prop_fields):
    prop = abi.allocation_prop(drv.ordinal)
    for key, value in prop_fields.items():
        if key == "location_type":
            prop.location.type = value
        elif key == "compression":
            prop.allocFlags.compressionType = value
        else:
            setattr(prop, key, value)
    h = c_ulonglong()
    return drv.cu.cuMemCreate(byref(h), size, byref(prop), flags)


def _reserve_with(drv, size, alignment=0, flags=0):
    p = c_ulonglong()
    return drv.cu.cuMemAddressReserve(byref(p), size, alignment, 0, flags)


def _set_access_with(drv, ptr, size, flags=abi.CU_MEM_ACCESS_FLAGS_PROT_READWRITE, ordinal=None):
    desc = abi.access_desc(drv.ordinal if ordinal is None else ordinal, flags)
    return drv.cu.cuMemSetAccess(ptr, size, byref(desc), 1)


def _copy_to(drv, ptr, n=16):
    buf = ctypes.create_string_buffer(n)
    return drv.cu.cuMemcpyHtoDAsync(ptr, buf, n, None)


def _released_handle(drv):
    h = drv.create()
    drv.release(h)
    return h


# name: (setup(drv) -> context, violation(drv, context) -> CUresult, code, words in message)
RULES = {
    "create: size not a multiple of the granularity": (
        lambda d: None, lambda d, c: _create_with(d, GRANULARITY + PAGE),
        abi.CUDA_ERROR_INVALID_VALUE, "multiple of the granularity"),
    "create: size 0": (
        lambda d: None, lambda d, c: _create_with(d, 0),
        abi.CUDA_ERROR_INVALID_VALUE, "multiple of the granularity"),
    "create: flags not 0": (
        lambda d: None, lambda d, c: _create_with(d, flags=1),
        abi.CUDA_ERROR_INVALID_VALUE, "must be 0"),
    "create: prop.type not PINNED": (
        lambda d: None, lambda d, c: _create_with(d, type=0),
        abi.CUDA_ERROR_INVALID_VALUE, "prop->type"),
    "create: prop.location.type not DEVICE": (
        lambda d: None, lambda d, c: _create_with(d, location_type=2),
        abi.CUDA_ERROR_INVALID_VALUE, "prop->location.type"),
    "create: exportable handle types": (
        lambda d: None, lambda d, c: _create_with(d, requestedHandleTypes=1),
        abi.CUDA_ERROR_NOT_SUPPORTED, "requestedHandleTypes"),
    "create: allocFlags set": (
        lambda d: None, lambda d, c: _create_with(d, compression=1),
        abi.CUDA_ERROR_NOT_SUPPORTED, "allocFlags"),
    "create: beyond capacity": (
        lambda d: None, lambda d, c: _create_with(d, 66 * MiB),
        abi.CUDA_ERROR_OUT_OF_MEMORY, "capacity"),
    "reserve: size not a multiple of the page size": (
        lambda d: None, lambda d, c: _reserve_with(d, GRANULARITY + 1),
        abi.CUDA_ERROR_INVALID_VALUE, "host page size"),
    "reserve: alignment not a power of two": (
        lambda d: None, lambda d, c: _reserve_with(d, GRANULARITY, alignment=3 * MiB),
        abi.CUDA_ERROR_INVALID_VALUE, "power of two"),
    "reserve: flags not 0": (
        lambda d: None, lambda d, c: _reserve_with(d, GRANULARITY, flags=1),
        abi.CUDA_ERROR_INVALID_VALUE, "must be 0"),
    "free_address: not the base of a reservation": (
        lambda d: d.reserve(), lambda d, p: d.cu.cuMemAddressFree(p + GRANULARITY, GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "not the base of a reservation"),
    "free_address: size differs from the reservation": (
        lambda d: d.reserve(), lambda d, p: d.cu.cuMemAddressFree(p, GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "does not match the reservation"),
    "free_address: still mapped": (
        lambda d: d.mapped()[0], lambda d, p: d.cu.cuMemAddressFree(p, 2 * GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "unmap it first"),
    "free_address: outside every reservation": (
        lambda d: None, lambda d, c: d.cu.cuMemAddressFree(0x1000, GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "not inside any reservation"),
    "map: offset not 0": (
        lambda d: (d.reserve(), d.create()), lambda d, c: d.cu.cuMemMap(c[0], GRANULARITY,
                                                                        GRANULARITY, c[1], 0),
        abi.CUDA_ERROR_INVALID_VALUE, "offset"),
    "map: flags not 0": (
        lambda d: (d.reserve(), d.create()), lambda d, c: d.cu.cuMemMap(c[0], GRANULARITY, 0,
                                                                        c[1], 1),
        abi.CUDA_ERROR_INVALID_VALUE, "must be 0"),
    "map: address not a multiple of the granularity": (
        lambda d: (d.reserve(), d.create()), lambda d, c: d.cu.cuMemMap(c[0] + PAGE, GRANULARITY,
                                                                        0, c[1], 0),
        abi.CUDA_ERROR_NOT_SUPPORTED, "multiple of the granularity"),
    "map: range not inside one reservation": (
        lambda d: (d.reserve(), d.create(2 * GRANULARITY)),
        lambda d, c: d.cu.cuMemMap(c[0] + 3 * GRANULARITY, 2 * GRANULARITY, 0, c[1], 0),
        abi.CUDA_ERROR_INVALID_VALUE, "not inside one reservation"),
    "map: larger than the allocation": (
        lambda d: (d.reserve(), d.create()),
        lambda d, c: d.cu.cuMemMap(c[0], 2 * GRANULARITY, 0, c[1], 0),
        abi.CUDA_ERROR_INVALID_VALUE, "exceeds the size"),
    "map: onto a mapped range": (
        lambda d: (d.mapped()[0], d.create()),
        lambda d, c: d.cu.cuMemMap(c[0], GRANULARITY, 0, c[1], 0),
        abi.CUDA_ERROR_INVALID_VALUE, "overlaps the mapping"),
    "map: a released handle": (
        lambda d: (d.reserve(), _released_handle(d)),
        lambda d, c: d.cu.cuMemMap(c[0], GRANULARITY, 0, c[1], 0),
        abi.CUDA_ERROR_INVALID_VALUE, "not a live allocation"),
    "unmap: a sub-range of a mapping": (
        lambda d: d.mapped(2 * GRANULARITY)[0],
        lambda d, p: d.cu.cuMemUnmap(p, GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "sub-range"),
    "unmap: nothing mapped there": (
        lambda d: d.reserve(), lambda d, p: d.cu.cuMemUnmap(p, GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "not mapped"),
    "set_access: range not fully mapped": (
        lambda d: d.mapped(access=False)[0],
        lambda d, p: _set_access_with(d, p, 2 * GRANULARITY),
        abi.CUDA_ERROR_INVALID_VALUE, "every byte must be mapped"),
    "set_access: read-only": (
        lambda d: d.mapped(access=False)[0],
        lambda d, p: _set_access_with(d, p, GRANULARITY, abi.CU_MEM_ACCESS_FLAGS_PROT_READ),
        abi.CUDA_ERROR_NOT_SUPPORTED, "PROT_READWRITE"),
    "set_access: not a CUmemAccess_flags value": (
        lambda d: d.mapped(access=False)[0],
        lambda d, p: _set_access_with(d, p, GRANULARITY, 2),
        abi.CUDA_ERROR_INVALID_VALUE, "not a CUmemAccess_flags value"),
    "set_access: no descriptor": (
        lambda d: d.mapped(access=False)[0],
        lambda d, p: d.cu.cuMemSetAccess(p, GRANULARITY, None, 0),
        abi.CUDA_ERROR_INVALID_VALUE, "desc is NULL"),
    "release: unknown handle": (
        lambda d: None, lambda d, c: d.cu.cuMemRelease(987654321),
        abi.CUDA_ERROR_INVALID_VALUE, "not a live allocation"),
    "release: twice": (
        lambda d: _released_handle(d), lambda d, h: d.cu.cuMemRelease(h),
        abi.CUDA_ERROR_INVALID_VALUE, "already released"),
    "copy: mapped but no access set": (
        lambda d: d.mapped(access=False)[0], lambda d, p: _copy_to(d, p),
        abi.CUDA_ERROR_INVALID_VALUE, "not accessible"),
    "copy: not device memory": (
        lambda d: None, lambda d, c: _copy_to(d, 0x1000),
        abi.CUDA_ERROR_INVALID_VALUE, "not inside any reservation"),
    "host_free: not pinned memory": (
        lambda d: ctypes.create_string_buffer(16),
        lambda d, buf: d.cu.cuMemFreeHost(ctypes.addressof(buf)),
        abi.CUDA_ERROR_INVALID_VALUE, "not pinned memory"),
    "host_alloc: unknown flags": (
        lambda d: None, lambda d, c: d.cu.cuMemHostAlloc(byref(c_void_p()), 4096, 8),
        abi.CUDA_ERROR_INVALID_VALUE, "Flags is 8"),
    "stream_destroy: unknown stream": (
        lambda d: None, lambda d, c: d.cu.cuStreamDestroy(0x1234560),
        abi.CUDA_ERROR_INVALID_HANDLE, "not a live stream"),
    "stream_destroy: the default stream": (
        lambda d: None, lambda d, c: d.cu.cuStreamDestroy(None),
        abi.CUDA_ERROR_INVALID_HANDLE, "default stream"),
    "stream_create: unknown flags": (
        lambda d: None, lambda d, c: d.cu.cuStreamCreate(byref(c_void_p()), 2),
        abi.CUDA_ERROR_INVALID_VALUE, "Flags is 2"),
    "event_record: unknown event": (
        lambda d: None, lambda d, c: d.cu.cuEventRecord(0x7654320, None),
        abi.CUDA_ERROR_INVALID_HANDLE, "not a live event"),
    "event_create: interprocess": (
        lambda d: None,
        lambda d, c: d.cu.cuEventCreate(byref(c_void_p()), abi.CU_EVENT_INTERPROCESS | 2),
        abi.CUDA_ERROR_NOT_SUPPORTED, "interprocess"),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_violation_returns_code_says_why_and_changes_nothing(drv, rule):
    setup, violate, code, words = RULES[rule]
    context = setup(drv)
    before = drv.state()
    result = violate(drv, context)
    message = drv.emu.last_error()
    assert result == code, message
    assert words in message
    assert message.split(": ")[1] == vmalloc.errors.cu_result_name(code)
    assert drv.state() == before


def test_nothing_changed_also_in_the_device_memory(drv):
    ptr, handle = drv.mapped()
    drv.write(ptr, b"kept")
    other = drv.create()
    assert drv.cu.cuMemMap(ptr, GRANULARITY, 0, other, 0) == abi.CUDA_ERROR_INVALID_VALUE
    assert drv.cu.cuMemUnmap(ptr + PAGE, GRANULARITY) == abi.CUDA_ERROR_INVALID_VALUE
    assert drv.read(ptr, 4) == b"kept"


# ---------------------------------------------------------------------------------------------
# Memory semantics.

def test_release_while_mapped_keeps_the_memory_until_unmapped(drv):
    ptr, handle = drv.mapped()
    drv.write(ptr, b"still here")
    drv.release(handle)
    state = drv.state()
    assert (state["handles"], state["released_still_mapped"]) == (0, 1)
    assert state["bytes_created"] == GRANULARITY
    assert drv.read(ptr, 10) == b"still here"
    drv.unmap(ptr, GRANULARITY)
    assert drv.state()["bytes_created"] == 0


def test_remap_moves_the_data_and_starts_inaccessible(drv):
    ptr, handle = drv.mapped()
    drv.write(ptr, b"moved bytes")
    drv.unmap(ptr, GRANULARITY)
    other = drv.reserve(2 * GRANULARITY)
    drv.map(other, GRANULARITY, handle)
    assert _copy_to(drv, other) == abi.CUDA_ERROR_INVALID_VALUE
    drv.set_access(other, GRANULARITY)
    assert drv.read(other, 11) == b"moved bytes"


def test_one_set_access_over_adjacent_mappings(drv):
    base = drv.reserve(4 * GRANULARITY)
    handles = [drv.create() for _ in range(3)]
    for i, h in enumerate(handles):
        drv.map(base + i * GRANULARITY, GRANULARITY, h)
    drv.set_access(base, 3 * GRANULARITY)
    drv.write(base + GRANULARITY - 2, b"span")
    assert drv.read(base + GRANULARITY - 2, 4) == b"span"
    # One unmap may cover several whole mappings.
    assert drv.cu.cuMemUnmap(base, 2 * GRANULARITY) == 0
    drv.mappings.remove((base, GRANULARITY))
    drv.mappings.remove((base + GRANULARITY, GRANULARITY))
    assert drv.state()["mappings"] == 1


def test_touching_memory_before_set_access_faults_for_real():
    # The mapping is PROT_NONE until cuMemSetAccess: a host access dies with SIGSEGV.
    code = """
        ctx = c_void_p()
        assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
        assert cu.cuCtxSetCurrent(ctx) == 0
        prop = abi.allocation_prop(0)
        h, p = c_ulonglong(), c_ulonglong()
        assert cu.cuMemCreate(byref(h), 2 << 20, byref(prop), 0) == 0
        assert cu.cuMemAddressReserve(byref(p), 2 << 20, 0, 0, 0) == 0
        assert cu.cuMemMap(p.value, 2 << 20, 0, h.value, 0) == 0
        desc = abi.access_desc(0)
        if {access}:
            assert cu.cuMemSetAccess(p.value, 2 << 20, byref(desc), 1) == 0
        ctypes.memset(p.value, 7, 16)
        print("touched", ctypes.string_at(p.value, 2))
    """
    ok = run_python(code.format(access=True))
    assert "touched b'\\x07\\x07'" in ok.stdout
    run_python(code.format(access=False), expect_returncode=-signal.SIGSEGV)


def test_pinned_host_memory_and_async_copies(drv):
    cu = drv.cu
    ptr, _ = drv.mapped()
    host = c_void_p()
    drv.ok(cu.cuMemHostAlloc(byref(host), 4096, abi.CU_MEMHOSTALLOC_PORTABLE))
    assert drv.state()["host_allocations"] == 1 and drv.state()["host_bytes"] == 4096
    ctypes.memmove(host.value, b"pinned!", 7)
    stream = c_void_p()
    drv.ok(cu.cuStreamCreate(byref(stream), abi.CU_STREAM_NON_BLOCKING))
    drv.ok(cu.cuMemcpyHtoDAsync(ptr, host, 7, stream))
    drv.ok(cu.cuMemcpyDtoDAsync(ptr + 100, ptr, 7, stream))
    out = ctypes.create_string_buffer(7)
    drv.ok(cu.cuMemcpyDtoHAsync(out, ptr + 100, 7, stream))
    drv.ok(cu.cuStreamSynchronize(stream))
    assert out.raw == b"pinned!"
    assert cu.cuMemcpyHtoDAsync(ptr, host, 0, stream) == 0  # zero bytes: nothing to do
    drv.ok(cu.cuStreamDestroy(stream))
    drv.ok(cu.cuMemFreeHost(host))
    assert drv.state()["host_allocations"] == 0 and drv.state()["streams"] == 0


def test_events(drv):
    cu = drv.cu
    event, stream = c_void_p(), c_void_p()
    drv.ok(cu.cuEventCreate(byref(event), abi.CU_EVENT_DISABLE_TIMING))
    assert cu.cuEventQuery(event) == 0  # never recorded: complete
    drv.ok(cu.cuStreamCreate(byref(stream), abi.CU_STREAM_NON_BLOCKING))
    drv.ok(cu.cuEventRecord(event, stream))
    drv.ok(cu.cuEventSynchronize(event))
    assert cu.cuEventQuery(event) == 0
    drv.ok(cu.cuStreamWaitEvent(None, event, 0))
    assert cu.cuStreamWaitEvent(None, event, 1) == abi.CUDA_ERROR_INVALID_VALUE
    drv.ok(cu.cuCtxSynchronize())
    assert drv.state()["events"] == 1
    drv.ok(cu.cuEventDestroy(event))
    assert cu.cuEventQuery(event) == abi.CUDA_ERROR_INVALID_HANDLE
    drv.ok(cu.cuStreamDestroy(stream))


# ---------------------------------------------------------------------------------------------
# Contexts.

def test_calls_need_a_current_context(drv, cu, emu):
    results = {}

    def other_thread():  # a new thread has no current context
        p, ctx = c_ulonglong(), c_void_p()
        results["reserve"] = cu.cuMemAddressReserve(byref(p), GRANULARITY, 0, 0, 0)
        results["message"] = emu.last_error()
        results["get"] = cu.cuCtxGetCurrent(byref(ctx))
        results["current"] = ctx.value
        results["pop"] = cu.cuCtxPopCurrent(byref(ctx))
        results["set"] = cu.cuCtxSetCurrent(drv.context)
        results["reserve_after_set"] = cu.cuMemAddressReserve(byref(p), GRANULARITY, 0, 0, 0)
        results["free"] = cu.cuMemAddressFree(p.value, GRANULARITY)
        results["unset"] = cu.cuCtxSetCurrent(None)
        results["current_after_unset"] = cu.cuCtxGetCurrent(byref(ctx)) or ctx.value

    before = drv.state()
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert results["reserve"] == abi.CUDA_ERROR_INVALID_CONTEXT
    assert "no context is current on this thread" in results["message"]
    assert (results["get"], results["current"]) == (0, None)
    assert results["pop"] == abi.CUDA_ERROR_INVALID_CONTEXT
    assert results["set"] == 0 and results["reserve_after_set"] == 0 and results["free"] == 0
    assert results["unset"] == 0 and results["current_after_unset"] is None
    assert drv.state() == before


def test_context_stack_and_released_primary_context(drv, cu, emu):
    assert cu.cuCtxSetCurrent(0xDEAD0) == abi.CUDA_ERROR_INVALID_CONTEXT
    assert cu.cuCtxPushCurrent(None) == abi.CUDA_ERROR_INVALID_VALUE
    current = c_void_p()
    assert cu.cuCtxGetCurrent(byref(current)) == 0 and current.value == drv.context
    # Retain twice more, release twice: still usable; the fixture's own release ends it.
    ctx = c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(byref(ctx), drv.ordinal) == 0
    assert ctx.value == drv.context and emu.device_state(drv.ordinal)["primary_context_refs"] == 2
    assert cu.cuDevicePrimaryCtxRelease(drv.ordinal) == 0
    drv.reserve()
    # With no reference left, the context is not usable any more.
    assert cu.cuDevicePrimaryCtxRelease(drv.ordinal) == 0
    p = c_ulonglong()
    assert cu.cuMemAddressReserve(byref(p), GRANULARITY, 0, 0, 0) == abi.CUDA_ERROR_INVALID_CONTEXT
    assert "not retained" in emu.last_error()
    assert cu.cuDevicePrimaryCtxRelease(drv.ordinal) == abi.CUDA_ERROR_INVALID_CONTEXT
    assert "more releases than retains" in emu.last_error()
    assert cu.cuDevicePrimaryCtxRetain(byref(ctx), drv.ordinal) == 0  # for the fixture


def test_calls_before_cuInit_are_not_initialized():
    proc = run_python("""
        d, n, v, name = c_int(), c_int(), c_int(), c_char_p()
        print(cu.cuDeviceGet(byref(d), 0), cu.cuDeviceGetCount(byref(n)),
              cu.cuDriverGetVersion(byref(v)), cu.cuGetErrorName(3, byref(name)), name.value)
        print(emu.last_error())
        print(cu.cuInit(1), cu.cuInit(0), cu.cuDeviceGetCount(byref(n)), n.value)
    """)
    lines = proc.stdout.splitlines()
    assert lines[0] == "3 3 0 0 b'CUDA_ERROR_NOT_INITIALIZED'"
    assert lines[1] == ("cuDeviceGetCount: CUDA_ERROR_NOT_INITIALIZED: cuInit(0) has not been "
                        "called (or the emulator was reset)")
    assert lines[2] == "1 0 0 1"


# ---------------------------------------------------------------------------------------------
# Several devices.

def test_environment_configures_devices_capacity_and_granularity():
    proc = run_python("""
        n, total, g = c_int(), c_size_t(), c_size_t()
        assert cu.cuInit(0) == 0 and cu.cuDeviceGetCount(byref(n)) == 0
        assert cu.cuDeviceTotalMem(byref(total), 2) == 0
        ctx = c_void_p()
        assert cu.cuDevicePrimaryCtxRetain(byref(ctx), 2) == 0 and cu.cuCtxSetCurrent(ctx) == 0
        prop = abi.allocation_prop(2)
        assert cu.cuMemGetAllocationGranularity(byref(g), byref(prop), 0) == 0
        print(n.value, total.value, g.value)
    """, env={"VMALLOC_EMULATOR_DEVICES": "3", "VMALLOC_EMULATOR_CAPACITY": "256MiB",
              "VMALLOC_EMULATOR_GRANULARITY": "64KiB"})
    assert proc.stdout.split() == ["3", str(256 * MiB), str(64 * 1024)]


@pytest.mark.parametrize("variable,value,words", [
    ("VMALLOC_EMULATOR_DEVICES", "lots", "is not a device count"),
    ("VMALLOC_EMULATOR_CAPACITY", "16 furlongs", "is not a size"),
    ("VMALLOC_EMULATOR_GRANULARITY", "3MiB", "power-of-two multiple"),
    ("VMALLOC_EMULATOR_FAIL", "cuMemMap:0:2", "nth must be a call number"),
    ("VMALLOC_EMULATOR_FAIL", "cuNoSuchThing:1:2", "not an entry point"),
])
def test_invalid_environment_fails_cuInit_and_says_why(variable, value, words):
    proc = run_python("print(cu.cuInit(0)); print(emu.last_error())", env={variable: value})
    result, message = proc.stdout.splitlines()
    assert result == "1"
    assert variable in message and words in message
    assert words in proc.stderr  # also said at load


def test_zero_devices_is_no_device():
    proc = run_python("print(cu.cuInit(0))", env={"VMALLOC_EMULATOR_DEVICES": "0"})
    assert proc.stdout.strip() == "100"


def test_devices_are_separate(drv, cu, emu):
    other = idle_ordinal(emu)  # drv's own device is not idle
    emu.configure_device(other, capacity=4 * MiB)
    ctx = c_void_p()
    drv.ok(cu.cuDevicePrimaryCtxRetain(byref(ctx), other))
    mine, handle = drv.mapped()
    h = c_ulonglong()
    prop = abi.allocation_prop(other)
    # Memory of the other device, created while this device's context is current.
    drv.ok(cu.cuMemCreate(byref(h), GRANULARITY, byref(prop), 0))
    assert emu.device_state(other)["handles"] == 1
    assert emu.device_state(drv.ordinal)["handles"] == 1
    # Its capacity is its own: 4 MiB.
    h2 = c_ulonglong()
    assert cu.cuMemCreate(byref(h2), 4 * MiB, byref(prop), 0) == abi.CUDA_ERROR_OUT_OF_MEMORY
    # Mapping it into this device's reservation is not emulated.
    free_part = mine + GRANULARITY
    assert cu.cuMemMap(free_part, GRANULARITY, 0, h.value, 0) == abi.CUDA_ERROR_NOT_SUPPORTED
    # Peer access is not emulated either.
    assert _set_access_with(drv, mine, GRANULARITY, ordinal=other) == abi.CUDA_ERROR_NOT_SUPPORTED
    # An event of the other device cannot be recorded on this device's stream.
    drv.ok(cu.cuCtxPushCurrent(ctx))
    event = c_void_p()
    drv.ok(cu.cuEventCreate(byref(event), abi.CU_EVENT_DISABLE_TIMING))
    drv.ok(cu.cuCtxPopCurrent(None))
    assert cu.cuEventRecord(event, None) == abi.CUDA_ERROR_INVALID_HANDLE
    drv.ok(cu.cuStreamWaitEvent(None, event, 0))  # waiting on it is fine (cross-device)
    drv.ok(cu.cuEventDestroy(event))
    drv.ok(cu.cuMemRelease(h.value))
    drv.ok(cu.cuDevicePrimaryCtxRelease(other))
    assert emu.leak_report(other) == ""


# ---------------------------------------------------------------------------------------------
# Leak report.

def test_leak_report_names_each_leaked_resource_exactly(drv, cu, emu):
    handle = drv.create()
    line = (f"device {drv.ordinal}: physical allocation handle {handle} of 2.00 MiB "
            "(2097152 bytes) not released (cuMemRelease)\n")
    context_line = (f"device {drv.ordinal}: primary context retained 1 time(s), not released "
                    "(cuDevicePrimaryCtxRelease)\n")
    assert emu.leak_report(drv.ordinal) == context_line + line
    assert line in emu.leak_report()
    ptr = drv.reserve(2 * GRANULARITY)
    drv.map(ptr, GRANULARITY, handle)
    stream, event, host = c_void_p(), c_void_p(), c_void_p()
    drv.ok(cu.cuStreamCreate(byref(stream), 0))
    drv.ok(cu.cuEventCreate(byref(event), 2))
    drv.ok(cu.cuMemHostAlloc(byref(host), 8192, 0))
    report = emu.leak_report(drv.ordinal).splitlines()
    assert report == [
        context_line.strip(), line.strip(),
        f"device {drv.ordinal}: reservation at {ptr:#x} of 4.00 MiB (4194304 bytes) not freed "
        "(cuMemAddressFree)",
        f"device {drv.ordinal}: mapping at {ptr:#x} of 2.00 MiB (2097152 bytes) (handle "
        f"{handle}) not unmapped (cuMemUnmap)",
        f"device {drv.ordinal}: pinned host memory at {host.value:#x} of 8.00 KiB (8192 bytes) "
        "not freed (cuMemFreeHost)",
        f"device {drv.ordinal}: stream {stream.value:#x} not destroyed (cuStreamDestroy)",
        f"device {drv.ordinal}: event {event.value:#x} not destroyed (cuEventDestroy)",
    ]
    drv.ok(cu.cuMemFreeHost(host))
    drv.ok(cu.cuEventDestroy(event))
    drv.ok(cu.cuStreamDestroy(stream))
    drv.cleanup()
    assert emu.leak_report(drv.ordinal) == context_line


def test_leak_report_at_exit_goes_to_stderr_and_the_file(tmp_path):
    report = tmp_path / "leaks.txt"
    proc = run_python("""
        ctx, h = c_void_p(), c_ulonglong()
        assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
        assert cu.cuCtxSetCurrent(ctx) == 0
        prop = abi.allocation_prop(0)
        assert cu.cuMemCreate(byref(h), 2 << 20, byref(prop), 0) == 0
        assert cu.cuDevicePrimaryCtxRelease(0) == 0
        print(h.value)
    """, env={"VMALLOC_EMULATOR_LEAK_REPORT": str(report)})
    handle = int(proc.stdout)
    expected = (f"device 0: physical allocation handle {handle} of 2.00 MiB (2097152 bytes) not "
                "released (cuMemRelease)\n")
    assert report.read_text() == expected
    assert proc.stderr == "vmalloc driver emulator: leaked at exit:\n" + expected
    clean = tmp_path / "clean.txt"
    proc = run_python("assert cu.cuInit(0) == 0",
                      env={"VMALLOC_EMULATOR_LEAK_REPORT": str(clean)})
    assert clean.read_text() == "" and proc.stderr == ""


# ---------------------------------------------------------------------------------------------
# Fault injection.

def test_fault_from_the_environment_fails_the_nth_call_only():
    proc = run_python("""
        ctx, h = c_void_p(), c_ulonglong()
        assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
        assert cu.cuCtxSetCurrent(ctx) == 0
        prop = abi.allocation_prop(0)
        print([cu.cuMemCreate(byref(h), 2 << 20, byref(prop), 0) for _ in range(4)])
        print(emu.last_error())
        print(emu.device_state(0)["handles"], emu.call_count("cuMemCreate"))
    """, env={"VMALLOC_EMULATOR_FAIL": "cuMemCreate:2:2, cuMemCreate:4:CUDA_ERROR_UNKNOWN"})
    results, message, counts = proc.stdout.splitlines()
    assert results == "[0, 2, 0, 999]"
    assert message == ("cuMemCreate: CUDA_ERROR_UNKNOWN: injected fault: call 4 of cuMemCreate "
                       "fails with CUDA_ERROR_UNKNOWN")
    assert counts == "2 4"  # two created; every call counted, failed ones too


def test_faults_through_the_control_functions(drv, cu, emu):
    base = emu.call_count("cuMemAddressReserve")
    emu.set_fault("cuMemAddressReserve", nth=2, code=2, count=2)
    results = []
    for _ in range(4):
        p = c_ulonglong()
        results.append(cu.cuMemAddressReserve(byref(p), GRANULARITY, 0, 0, 0))
        if results[-1] == 0:
            drv.reservations.append((p.value, GRANULARITY))
    assert results == [0, 2, 2, 0]
    assert emu.call_count("cuMemAddressReserve") == base + 4
    assert drv.state()["reservations"] == 2  # the failed calls reserved nothing
    # count 0: every call from the nth on, until cleared. cuda.h names work for _v2 symbols.
    emu.set_fault("cuStreamDestroy", nth=1, code="CUDA_ERROR_INVALID_HANDLE", count=0)
    stream = c_void_p()
    drv.ok(cu.cuStreamCreate(byref(stream), 1))
    assert [cu.cuStreamDestroy(stream) for _ in range(3)] == [400, 400, 400]
    emu.clear_faults()
    drv.ok(cu.cuStreamDestroy(stream))
    with emu.fault("cuMemcpyHtoDAsync_v2", 1, 700):
        assert _copy_to(drv, 0x1000) == 700
    assert _copy_to(drv, 0x1000) == abi.CUDA_ERROR_INVALID_VALUE
    emu.set_faults("cuEventQuery:1:600")
    event = c_void_p()
    drv.ok(cu.cuEventCreate(byref(event), 2))
    assert cu.cuEventQuery(event) == abi.CUDA_ERROR_NOT_READY
    assert cu.cuEventQuery(event) == 0
    drv.ok(cu.cuEventDestroy(event))


def test_fault_control_rejects_bad_requests(emu):
    with pytest.raises(vmalloc.DeviceError, match="not an entry point"):
        emu.set_fault("cuLaunchKernel")
    with pytest.raises(vmalloc.DeviceError, match="nth must be >= 1"):
        emu.set_fault("cuMemMap", nth=0)
    with pytest.raises(vmalloc.DeviceError, match="is not entry:nth:code"):
        emu.set_faults("cuMemMap:3")
    with pytest.raises(vmalloc.DeviceError, match="not a failing CUresult"):
        emu.set_faults("cuMemMap:1:0")
    assert emu.call_count("cuNoSuchCall") == 0


def test_verbose_prints_every_failure():
    proc = run_python("print(cu.cuInit(5))", env={"VMALLOC_EMULATOR_VERBOSE": "1"})
    assert proc.stderr == ("vmalloc driver emulator: cuInit: CUDA_ERROR_INVALID_VALUE: flags must "
                           "be 0, got 5\n")


def test_configure_refuses_a_device_in_use(drv, emu):
    with pytest.raises(vmalloc.DeviceError, match="is in use") as info:
        emu.configure_device(drv.ordinal, capacity=8 * MiB)
    assert info.value.code == abi.CUDA_ERROR_NOT_PERMITTED
    assert emu.device_state(drv.ordinal)["capacity"] == 64 * MiB


def test_reset_starts_over():
    proc = run_python("""
        ctx, n = c_void_p(), c_int()
        assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
        emu.add_device()
        emu.set_fault("cuInit", 1, 2)
        emu.reset()
        print(emu.leak_report() == "", emu.device_count(), emu.call_count("cuInit"))
        print(cu.cuDeviceGetCount(byref(n)), cu.cuInit(0), cu.cuCtxSetCurrent(ctx))
    """)
    assert proc.stdout.splitlines() == ["True 1 0", "3 0 201"]


def test_non_blocking_streams_do_not_wait_for_the_default_stream(drv, emu):
    # The driver's ordering, made observable with a hold: a CU_STREAM_DEFAULT stream waits for
    # the held NULL stream, a CU_STREAM_NON_BLOCKING one does not (code that forgets an event
    # between them races on a GPU, and does here).
    cu = drv.cu
    blocking, free, e_blocking, e_free = c_void_p(), c_void_p(), c_void_p(), c_void_p()
    drv.ok(cu.cuStreamCreate(byref(blocking), 0))
    drv.ok(cu.cuStreamCreate(byref(free), abi.CU_STREAM_NON_BLOCKING))
    drv.ok(cu.cuEventCreate(byref(e_blocking), abi.CU_EVENT_DISABLE_TIMING))
    drv.ok(cu.cuEventCreate(byref(e_free), abi.CU_EVENT_DISABLE_TIMING))
    token = emu.hold_stream(0)
    assert token[0] == drv.ordinal
    drv.ok(cu.cuEventRecord(e_blocking, blocking))
    drv.ok(cu.cuEventRecord(e_free, free))
    # e_free completes while the NULL stream is held (a bounded poll: a wrongful wait fails
    # the test instead of hanging it; a correct emulator completes at once).
    deadline = time.monotonic() + 60
    while cu.cuEventQuery(e_free) == abi.CUDA_ERROR_NOT_READY and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cu.cuEventQuery(e_free) == 0, "a non-blocking stream waited for the NULL stream"
    assert cu.cuEventQuery(e_blocking) == abi.CUDA_ERROR_NOT_READY
    emu.release_hold(token)
    drv.ok(cu.cuEventSynchronize(e_blocking))
    with pytest.raises(vmalloc.DeviceError, match="not a live hold|hold"):
        emu.release_hold(token)
    for e in (e_blocking, e_free):
        drv.ok(cu.cuEventDestroy(e))
    for s in (blocking, free):
        drv.ok(cu.cuStreamDestroy(s))
