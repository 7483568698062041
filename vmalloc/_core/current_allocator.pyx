# cython: language_level=3
"""The per-device current allocator (what the C ABI, PyTorch and CuPy allocate from) and the
location of libvmalloc.so, the library that exports the C ABI."""

import atexit

from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr
from libcpp.vector cimport vector

from vmalloc._core.allocator cimport Allocator, wrap_allocator
from vmalloc._core.device cimport wrap_device
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.alloc.current_allocator cimport (
    c_current_allocator,
    c_devices_with_current_allocator,
    c_set_current_allocator,
    max_registry_devices,
)
from vmalloc._lib.c_api cimport (
    vmalloc_abi_version,
    vmalloc_clear_last_error,
    vmalloc_cupy_free,
    vmalloc_cupy_malloc,
    vmalloc_last_error,
    vmalloc_last_error_code,
    vmalloc_torch_alloc,
    vmalloc_torch_empty_cache,
    vmalloc_torch_free,
    vmalloc_torch_record_stream,
)
from vmalloc._lib.dlfcn cimport Dl_info, dladdr

from vmalloc.errors import InvalidArgumentError


#: The vmalloc_status values of the C ABI (include/vmalloc/c_api.h), by name.
STATUS = {
    "VMALLOC_SUCCESS": 0,
    "VMALLOC_ERROR_INVALID_ARGUMENT": 1,
    "VMALLOC_ERROR_INVALID_POINTER": 2,
    "VMALLOC_ERROR_OUT_OF_MEMORY": 3,
    "VMALLOC_ERROR_DEVICE": 4,
    "VMALLOC_ERROR_NO_ALLOCATOR": 5,
    "VMALLOC_ERROR_INTERNAL": 6,
}

# The Python objects set per device, so that get_current_allocator returns the very object
# that was set. The C++ registry holds the shared ownership that counts.
cdef dict _python_allocators = {}


cdef int _check_device(device) except -1:
    if type(device) is not int:
        # bool is an int subclass but never meant as an ordinal
        if isinstance(device, bool) or not hasattr(device, "__index__"):
            raise TypeError(f"device must be an int ordinal, got {type(device).__name__}")
        device = device.__index__()
    if not 0 <= device < max_registry_devices:
        raise InvalidArgumentError(
            f"device ordinal {device} is out of range [0, {max_registry_devices})")
    return device


cdef shared_ptr[CAllocator] _current(int device):
    # The registry's lock is taken without the GIL (see Allocator: no entry point waits for a
    # C++ lock with the GIL held).
    cdef shared_ptr[CAllocator] c
    with nogil:
        c = c_current_allocator(device)
    return c


cdef void _replace(int device, shared_ptr[CAllocator] c_new) except *:
    # The allocator replaced may be destroyed here, which synchronizes its device: no GIL.
    cdef shared_ptr[CAllocator] old
    with nogil:
        old = c_set_current_allocator(device, c_new)
        old.reset()


cdef object _wrap(shared_ptr[CAllocator] c_allocator, int device):
    """The Python object for a C++ allocator of the registry."""
    if not c_allocator:
        return None
    cdef Allocator known = _python_allocators.get(device)
    if known is not None and known.c_allocator.get() == c_allocator.get():
        return known
    # Set through the C ABI: a plain wrapper sharing ownership.
    return wrap_allocator(c_allocator, wrap_device(c_allocator.get().device()))


def set_current_allocator(allocator, device=0):
    """Makes ``allocator`` the current allocator of CUDA device ordinal ``device``.

    The C ABI of libvmalloc.so, and through it PyTorch (:mod:`vmalloc.torch`) and CuPy
    (:mod:`vmalloc.cupy`), route that device's requests to it. ``None`` clears the device.
    Returns the allocator it replaces, or None.

    Raises :class:`vmalloc.InvalidArgumentError` when ``device`` is out of range, or when the
    allocator runs on a CUDA device of another ordinal.
    """
    cdef int d = _check_device(device)
    cdef Allocator a
    cdef shared_ptr[CAllocator] c_new
    if allocator is not None:
        if not isinstance(allocator, Allocator):
            raise TypeError(f"allocator must be a vmalloc.Allocator or None, "
                            f"got {type(allocator).__name__}")
        a = allocator
        a.get()  # raises for a Python subclass that holds no allocator
        dev = a.device
        if dev is not None and dev.name.startswith("cuda:") and dev.ordinal != d:
            raise InvalidArgumentError(
                f"allocator runs on {dev.name} but is being set for device {d}: memory of "
                f"one GPU must not serve another")
        c_new = a.c_allocator
    previous = _wrap(_current(d), d)
    _replace(d, c_new)
    if allocator is None:
        _python_allocators.pop(d, None)
    else:
        _python_allocators[d] = allocator
    return previous


def get_current_allocator(device=0):
    """The current allocator of device ordinal ``device``, or None when it has none."""
    cdef int d = _check_device(device)
    return _wrap(_current(d), d)


def devices_with_current_allocator():
    """The device ordinals that have a current allocator, ascending."""
    cdef vector[int] devices
    with nogil:
        devices = c_devices_with_current_allocator()
    return list(devices)


def library_path():
    """The absolute path of the loaded ``libvmalloc.so``, the library exporting the C ABI.

    Pass it to ``ctypes.CDLL`` or to PyTorch's ``CUDAPluggableAllocator``: loading this path
    again gives the same library, so it sees the allocators set with
    :func:`set_current_allocator`.
    """
    cdef Dl_info info
    if dladdr(<const void*>&vmalloc_abi_version, &info) == 0 or info.dli_fname == NULL:
        raise RuntimeError("cannot locate libvmalloc.so (dladdr failed)")
    import os

    return os.path.realpath(info.dli_fname.decode())


def abi_version():
    """``VMALLOC_C_API_VERSION`` of the loaded library."""
    return vmalloc_abi_version()


def last_error():
    """``(status, message)`` of the calling thread's most recent C ABI failure; ``(0, "")``
    when there was none. Statuses are the values of :data:`STATUS`."""
    return vmalloc_last_error_code(), vmalloc_last_error().decode(errors="replace")


def clear_last_error():
    """Forgets the calling thread's most recent C ABI failure."""
    vmalloc_clear_last_error()


def function_address(name):
    """The address of a C ABI function, for frameworks that take function pointers.

    ``name`` is one of ``vmalloc_torch_alloc``, ``vmalloc_torch_free``,
    ``vmalloc_torch_record_stream``, ``vmalloc_torch_empty_cache``, ``vmalloc_cupy_malloc``,
    ``vmalloc_cupy_free``.
    """
    cdef uintptr_t address
    if name == "vmalloc_torch_alloc":
        address = <uintptr_t>&vmalloc_torch_alloc
    elif name == "vmalloc_torch_free":
        address = <uintptr_t>&vmalloc_torch_free
    elif name == "vmalloc_torch_record_stream":
        address = <uintptr_t>&vmalloc_torch_record_stream
    elif name == "vmalloc_torch_empty_cache":
        address = <uintptr_t>&vmalloc_torch_empty_cache
    elif name == "vmalloc_cupy_malloc":
        address = <uintptr_t>&vmalloc_cupy_malloc
    elif name == "vmalloc_cupy_free":
        address = <uintptr_t>&vmalloc_cupy_free
    else:
        raise ValueError(f"no C ABI function named {name!r} is handed out")
    return address


def _clear_all():
    # At interpreter exit, destroy the allocators while their devices still work, instead of
    # during the C++ library's static destruction.
    cdef vector[int] devices
    with nogil:
        devices = c_devices_with_current_allocator()
    for d in devices:
        _replace(d, shared_ptr[CAllocator]())
    _python_allocators.clear()


atexit.register(_clear_all)
