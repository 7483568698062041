# cython: language_level=3
"""CudaDevice: the device interface over the CUDA driver's virtual memory management API."""

from libcpp.string cimport string

from vmalloc._core.device cimport Device
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.device.cuda_device cimport CCudaDevice
from vmalloc._lib.device.detail.cuda_driver cimport (
    default_driver_library,
    driver_entry_point_symbols,
)
from vmalloc._lib.device.device cimport CDevice


cdef class CudaDevice(Device):
    """A CUDA GPU, driven through the driver's virtual memory management API.

    Args:
        ordinal: the CUDA device number (as in ``cuDeviceGet``; ``CUDA_VISIBLE_DEVICES``
            applies).
        library: the driver library to load; default ``$VMALLOC_LIBCUDA`` if set, else
            ``libcuda.so.1``. :func:`vmalloc.testing.emulated_cuda_device` points it at the
            driver emulator.

    The driver is loaded here, not at ``import vmalloc``: without a driver this raises
    :class:`vmalloc.DeviceError` (``.call == "dlopen"``). The device retains the primary
    context (the one PyTorch and CuPy use) for its lifetime and makes it current around every
    driver call, from any thread. Streams and events are the driver's ``CUstream`` /
    ``CUevent`` handles as ints: a CuPy ``Stream`` or a PyTorch ``torch.cuda.Stream`` may be
    passed wherever a stream is expected. A failed call raises :class:`vmalloc.DeviceError`
    naming the entry point (``.call``) and the ``CUresult`` (``.code``, ``.code_name``);
    ``CUDA_ERROR_OUT_OF_MEMORY`` raises :class:`vmalloc.OutOfMemoryError`.

    Work queued on a stream may still use memory that is unmapped: synchronize first (the
    allocators do, with events). Whatever the device still owns when it is destroyed
    (allocations, reservations, mappings, pinned memory, streams, events) is freed then.
    """

    def __cinit__(self, int ordinal=0, library=None):
        cdef string path = b"" if library is None else str(library).encode()
        cdef CCudaDevice* device
        with nogil:
            device = new CCudaDevice(ordinal, path)
        self.c_device.reset(<CDevice*>device)

    def __init__(self, int ordinal=0, library=None):
        refuse_second_init(self, &self.init_called)

    cdef CCudaDevice* cuda(self) except NULL:
        return <CCudaDevice*>self.get()

    @property
    def library(self):
        """The driver library this device runs on (a path, or ``"libcuda.so.1"``)."""
        return self.cuda().library().decode()

    @property
    def driver_version(self):
        """``cuDriverGetVersion``: 12040 for CUDA 12.4."""
        return self.cuda().driver_version()

    @property
    def device_name(self):
        """``cuDeviceGetName``: the GPU's name."""
        return self.cuda().device_name().decode(errors="replace")

    @property
    def context(self):
        """The primary context (``CUcontext``) as an int."""
        return self.cuda().context_handle()

    @staticmethod
    def driver_entry_points():
        """The symbols CudaDevice resolves from the driver library, e.g.
        ``"cuMemcpyHtoDAsync_v2"`` (the versioned names cuda.h selects)."""
        return [name.decode() for name in driver_entry_point_symbols()]

    @staticmethod
    def default_library():
        """The library a CudaDevice loads by default: ``$VMALLOC_LIBCUDA`` or
        ``libcuda.so.1``."""
        return default_driver_library().decode()
