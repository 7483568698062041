"""ctypes bindings of the driver emulator (``vmalloc/testing/libcuda.so.1``): its control
functions (``vmallocEmulator*``) and, for tests, its driver entry points."""

import contextlib
import ctypes
import os
import threading
from pathlib import Path

from vmalloc.errors import DeviceError, cu_result_name
from vmalloc.sizes import parse_size

_LIBRARY_NAME = "libcuda.so.1"


def emulated_driver_path():
    """The path of the driver emulator, a stand-in ``libcuda.so.1`` shipped with vmalloc.

    Point ``VMALLOC_LIBCUDA`` at it (or pass it as ``CudaDevice(library=...)``) to run
    :class:`vmalloc.CudaDevice` without a GPU.
    """
    path = Path(__file__).parent / _LIBRARY_NAME
    if not path.exists():
        raise FileNotFoundError(f"the driver emulator is not built: {path} is missing")
    return str(path)


class VmallocEmulatorDeviceState(ctypes.Structure):
    """Mirror of the C struct ``VmallocEmulatorDeviceState`` (src/emulator/control.cpp)."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in (
        "capacity", "granularity", "primary_context_refs", "handles", "released_still_mapped",
        "bytes_created", "reservations", "bytes_reserved", "mappings", "bytes_mapped",
        "host_allocations", "host_bytes", "streams", "events")]


#: Counts of :meth:`DriverEmulator.device_state` that must be zero for a device to be idle.
RESOURCE_FIELDS = ("primary_context_refs", "handles", "released_still_mapped", "reservations",
                   "mappings", "host_allocations", "streams", "events")


def _setup(lib):
    c = ctypes
    signatures = {
        "vmallocEmulatorSetFault": (c.c_int, [c.c_char_p, c.c_ulonglong, c.c_int, c.c_ulonglong]),
        "vmallocEmulatorSetFaults": (c.c_int, [c.c_char_p]),
        "vmallocEmulatorClearFaults": (None, []),
        "vmallocEmulatorCallCount": (c.c_ulonglong, [c.c_char_p]),
        "vmallocEmulatorLeakReport": (c.c_size_t, [c.c_int, c.c_char_p, c.c_size_t]),
        "vmallocEmulatorLastError": (c.c_size_t, [c.c_char_p, c.c_size_t]),
        "vmallocEmulatorReset": (c.c_int, []),
        "vmallocEmulatorDeviceCount": (c.c_int, []),
        "vmallocEmulatorAddDevice": (c.c_int, [c.c_size_t, c.c_size_t, c.POINTER(c.c_int)]),
        "vmallocEmulatorConfigureDevice": (c.c_int, [c.c_int, c.c_size_t, c.c_size_t]),
        "vmallocEmulatorGetDeviceState": (
            c.c_int, [c.c_int, c.POINTER(VmallocEmulatorDeviceState)]),
        "vmallocEmulatorSetVerbose": (None, [c.c_int]),
        "vmallocEmulatorHoldStream": (
            c.c_int, [c.c_void_p, c.POINTER(c.c_int), c.POINTER(c.c_ulonglong)]),
        "vmallocEmulatorReleaseHold": (c.c_int, [c.c_int, c.c_ulonglong]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


class DriverEmulator:
    """Control of the driver emulator loaded in this process (see :func:`emulator`).

    Attributes:
        lib: the ``ctypes.CDLL`` of the emulator; its ``cu*`` entry points may be called
            directly (set ``argtypes`` first).
        path: the emulator's path.
    """

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        _setup(self.lib)

    # --- errors ---

    def last_error(self):
        """Why the calling thread's last failed driver or control call failed, e.g.
        ``"cuMemMap: CUDA_ERROR_INVALID_VALUE: ..."`` (``""`` if none failed yet)."""
        size = self.lib.vmallocEmulatorLastError(None, 0)
        buffer = ctypes.create_string_buffer(size + 1)
        self.lib.vmallocEmulatorLastError(buffer, size + 1)
        return buffer.value.decode(errors="replace")

    def _check(self, result, call):
        if result != 0:
            raise DeviceError(f"{call} failed: {cu_result_name(result)}: {self.last_error()}",
                              call, result)

    def set_verbose(self, verbose=True):
        """Print every failed call to stderr (as ``VMALLOC_EMULATOR_VERBOSE=1``)."""
        self.lib.vmallocEmulatorSetVerbose(1 if verbose else 0)

    # --- fault injection ---

    def set_fault(self, entry_point, nth=1, code="CUDA_ERROR_OUT_OF_MEMORY", count=1):
        """Makes calls ``nth`` .. ``nth + count - 1`` of ``entry_point`` (counted from now;
        ``count=0``: every call from the ``nth`` on) return ``code`` without doing anything.

        ``entry_point`` is a symbol or its cuda.h name (``"cuMemMap"``,
        ``"cuStreamDestroy"``); ``code`` a ``CUresult`` number or name.
        """
        code = _result_code(code)
        self._check(self.lib.vmallocEmulatorSetFault(entry_point.encode(), nth, code, count),
                    "vmallocEmulatorSetFault")

    def set_faults(self, spec):
        """Arms faults written as ``VMALLOC_EMULATOR_FAIL`` is (``"cuMemMap:3:2,..."``)."""
        self._check(self.lib.vmallocEmulatorSetFaults(spec.encode()), "vmallocEmulatorSetFaults")

    def clear_faults(self):
        """Disarms every fault."""
        self.lib.vmallocEmulatorClearFaults()

    @contextlib.contextmanager
    def fault(self, entry_point, nth=1, code="CUDA_ERROR_OUT_OF_MEMORY", count=1):
        """``with emu.fault("cuMemMap", 2):`` arms a fault for the block, then clears all."""
        self.set_fault(entry_point, nth, code, count)
        try:
            yield self
        finally:
            self.clear_faults()

    # --- stream holds ---

    def hold_stream(self, stream=0):
        """Blocks ``stream`` (a ``CUstream`` handle as an int; 0 is the calling thread's
        current context's default stream) like a kernel that runs until told to stop, and
        returns a token for :meth:`release_hold`. Until then, work queued behind it, and on
        streams that must wait for it, provably has not run: a test can show that code orders
        its streams with events (a ``CU_STREAM_NON_BLOCKING`` stream does not wait for the
        default stream, on a GPU and here)."""
        ordinal, hold = ctypes.c_int(), ctypes.c_ulonglong()
        self._check(self.lib.vmallocEmulatorHoldStream(stream or None, ctypes.byref(ordinal),
                                                       ctypes.byref(hold)),
                    "vmallocEmulatorHoldStream")
        return (ordinal.value, hold.value)

    def release_hold(self, token):
        """Lets the stream held by :meth:`hold_stream` go on (``token`` is what it returned)."""
        ordinal, hold = token
        self._check(self.lib.vmallocEmulatorReleaseHold(ordinal, hold),
                    "vmallocEmulatorReleaseHold")

    def call_count(self, entry_point):
        """Calls of ``entry_point`` since load or :meth:`reset` (failed ones included)."""
        return self.lib.vmallocEmulatorCallCount(entry_point.encode())

    # --- leaks and state ---

    def leak_report(self, ordinal=None):
        """Every resource still alive on device ``ordinal`` (all devices if None), one line
        each, e.g. ``"device 0: physical allocation handle 3 of 2.00 MiB (2097152 bytes) not
        released (cuMemRelease)"``; ``""`` when nothing leaked."""
        index = -1 if ordinal is None else int(ordinal)
        size = self.lib.vmallocEmulatorLeakReport(index, None, 0)
        buffer = ctypes.create_string_buffer(size + 1)
        self.lib.vmallocEmulatorLeakReport(index, buffer, size + 1)
        return buffer.value.decode(errors="replace")

    def device_count(self):
        """Number of emulated devices (no ``cuInit`` needed)."""
        return self.lib.vmallocEmulatorDeviceCount()

    def device_state(self, ordinal=0):
        """What device ``ordinal`` holds: a dict of ``capacity``, ``granularity``,
        ``primary_context_refs``, ``handles``, ``released_still_mapped``, ``bytes_created``,
        ``reservations``, ``bytes_reserved``, ``mappings``, ``bytes_mapped``,
        ``host_allocations``, ``host_bytes``, ``streams``, ``events``."""
        state = VmallocEmulatorDeviceState()
        self._check(self.lib.vmallocEmulatorGetDeviceState(int(ordinal), ctypes.byref(state)),
                    "vmallocEmulatorGetDeviceState")
        return {name: getattr(state, name) for name, _ in state._fields_}

    def idle(self, ordinal):
        """True when device ``ordinal`` has no retained context and holds nothing."""
        state = self.device_state(ordinal)
        return all(state[name] == 0 for name in RESOURCE_FIELDS)

    # --- configuration ---

    def add_device(self, capacity=None, granularity=None):
        """Adds an emulated device; returns its ordinal. None = the configured default."""
        ordinal = ctypes.c_int(-1)
        self._check(self.lib.vmallocEmulatorAddDevice(_size(capacity), _size(granularity),
                                                      ctypes.byref(ordinal)),
                    "vmallocEmulatorAddDevice")
        return ordinal.value

    def configure_device(self, ordinal, capacity=None, granularity=None):
        """Replaces idle device ``ordinal`` by a fresh one (None = the configured default);
        raises :class:`vmalloc.DeviceError` (``CUDA_ERROR_NOT_PERMITTED``) if it is in use."""
        self._check(self.lib.vmallocEmulatorConfigureDevice(int(ordinal), _size(capacity),
                                                            _size(granularity)),
                    "vmallocEmulatorConfigureDevice")

    def reset(self):
        """Back to the state after loading: devices rebuilt from the environment, no handles,
        contexts, faults or call counts; ``cuInit`` must be called again. Only while no
        :class:`vmalloc.CudaDevice` is alive (their handles become invalid)."""
        self._check(self.lib.vmallocEmulatorReset(), "vmallocEmulatorReset")


def _size(value):
    return 0 if value is None else parse_size(value)


def _result_code(code):
    if isinstance(code, int):
        return code
    from vmalloc.errors import _CU_RESULT_NAMES

    for number, name in _CU_RESULT_NAMES.items():
        if name == code:
            return number
    raise ValueError(f"unknown CUresult name {code!r}")


_lock = threading.Lock()
_emulator = None


def emulator():
    """The driver emulator of this process, loaded on first use (one per process).

    Loading it sets ``VMALLOC_LIBCUDA`` to its path (unless already set to it), so
    :class:`vmalloc.CudaDevice` created afterwards without ``library=`` run on it too. The
    ``VMALLOC_EMULATOR_*`` environment variables are read at this first load.
    """
    global _emulator
    with _lock:
        if _emulator is None:
            path = emulated_driver_path()
            os.environ["VMALLOC_LIBCUDA"] = path
            _emulator = DriverEmulator(path)
        return _emulator
