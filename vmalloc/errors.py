"""Exceptions raised by vmalloc.

Each C++ exception of the core (``include/vmalloc/base/errors.hpp``) arrives in Python as the
exception of the same meaning here. Every failed call leaves the allocator and the device as
they were.
"""


class VmallocError(Exception):
    """Base class of every vmalloc error."""


class InvalidArgumentError(VmallocError, ValueError):
    """A size, alignment, option or handle that can never be valid."""


class InvalidPointerError(VmallocError, ValueError):
    """A pointer that is not a live allocation of this allocator (double free, unknown or
    interior pointer)."""


class OutOfMemoryError(VmallocError, MemoryError):
    """The device, or the allocator's budget, cannot supply the request.

    Attributes:
        requested_bytes: the size of the request that failed.
        state: a one-line summary of the allocator or device when it failed.
        stats: the allocator's :class:`vmalloc.Stats` when raised by an allocator, else None.
    """

    def __init__(self, message, requested_bytes=None, state=""):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.state = state
        self.stats = None


class DeviceError(VmallocError, RuntimeError):
    """A device call failed or broke a rule of the CUDA driver API.

    Attributes:
        call: the driver entry point, for example ``"cuMemMap"``.
        code: the ``CUresult`` number (1 = CUDA_ERROR_INVALID_VALUE, ...).
        code_name: the ``CUresult`` name when known.
    """

    def __init__(self, message, call="", code=0, code_name=""):
        super().__init__(message)
        self.call = call
        self.code = code
        self.code_name = code_name or cu_result_name(code)


_CU_RESULT_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}


def cu_result_name(code):
    """The ``CUresult`` name of ``code`` (``"CUDA_ERROR_INVALID_VALUE"`` for 1)."""
    return _CU_RESULT_NAMES.get(code, f"CUresult {code}")


class TraceFormatError(VmallocError, ValueError):
    """A trace file that cannot be read: not the format it claims, truncated or corrupt.

    Attributes:
        path: the trace file, as given.
        record: the 1-based line (text formats) or record number (binary formats, pickled
            entries) where the problem is, or None when it concerns the whole file.
    """

    def __init__(self, message, path=None, record=None):
        where = ""
        if path is not None:
            where = f"{path}" + (f":{record}" if record is not None else "") + ": "
        super().__init__(where + message)
        self.path = path
        self.record = record
