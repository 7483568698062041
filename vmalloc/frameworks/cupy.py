"""The CuPy driver (``vmalloc.cupy``): a vmalloc allocator as CuPy's memory allocator
(:class:`use_vmalloc`), and out-of-core training over the :class:`vmalloc.offload.Runtime`
(:func:`out_of_core`).

::

    import vmalloc, vmalloc.cupy
    allocator = vmalloc.VirtualAllocator(vmalloc.CudaDevice(0))
    with vmalloc.cupy.use_vmalloc(allocator):
        x = cupy.zeros((1024, 1024))      # memory from `allocator`

Allocation and free run in C: CuPy calls the C ABI of libvmalloc.so through its
``CFunctionAllocator`` memory (``cupy.cuda.memory.CFunctionAllocatorMemory``), which hands the
C functions a ``param`` pointer and gives the same ``param`` back at free. vmalloc passes the
CUstream of CuPy's current stream as that ``param``, so every allocation is made for, and
freed on, the stream CuPy was using when it was made.

Importing this module never needs CuPy; using it without CuPy raises an ImportError that
says so.
"""

import threading

from vmalloc._core import current_allocator as _current_allocator
from vmalloc._core.current_allocator import STATUS, last_error
from vmalloc._core.device_map import as_device_map
from vmalloc.errors import InvalidArgumentError, OutOfMemoryError, VmallocError

__all__ = ["VmallocCupyAllocator", "array", "malloc", "out_of_core", "use_vmalloc"]


def _cupy():
    try:
        import cupy
        import cupy.cuda.memory
    except ImportError as error:
        raise ImportError(
            "vmalloc.cupy needs CuPy (pip install cupy-cuda12x, or the wheel for your CUDA "
            f"version): {error}") from error
    if not hasattr(cupy.cuda.memory, "CFunctionAllocatorMemory"):
        raise ImportError(f"vmalloc.cupy needs cupy.cuda.memory.CFunctionAllocatorMemory, which "
                          f"CuPy {cupy.__version__} does not have; use CuPy 9 or newer")
    return cupy


_oom_class = None
_oom_lock = threading.Lock()


def _out_of_memory_error_class():
    """An exception that is both CuPy's and vmalloc's OutOfMemoryError, made once CuPy is there."""
    global _oom_class
    with _oom_lock:
        if _oom_class is None:
            cupy_oom = _cupy().cuda.memory.OutOfMemoryError

            class CupyOutOfMemoryError(cupy_oom, OutOfMemoryError):
                """Out of memory in a vmalloc allocator serving CuPy: catch it as
                ``cupy.cuda.memory.OutOfMemoryError`` or as :class:`vmalloc.OutOfMemoryError`."""

                def __init__(self, message, size, total, stats=None):
                    MemoryError.__init__(self, message)
                    # CuPy's OutOfMemoryError attributes
                    self._size = size
                    self._total = total
                    self._limit = 0
                    # vmalloc's
                    self.requested_bytes = size
                    self.state = ""
                    self.stats = stats

                def __reduce__(self):
                    return (type(self), (str(self), self._size, self._total, self.stats))

            CupyOutOfMemoryError.__module__ = "vmalloc.cupy"   # its documented home
            _oom_class = CupyOutOfMemoryError
        return _oom_class


def _failure(size, device_id):
    """The exception for a vmalloc_cupy_malloc that returned NULL for ``size`` > 0."""
    code, message = last_error()
    if code == STATUS["VMALLOC_ERROR_OUT_OF_MEMORY"]:
        allocator = _current_allocator.get_current_allocator(device_id)
        stats = allocator.stats() if allocator is not None else None
        total = stats.requested_bytes if stats is not None else -1
        return _out_of_memory_error_class()(message, size, total, stats)
    if code == STATUS["VMALLOC_ERROR_INVALID_ARGUMENT"]:
        return InvalidArgumentError(message)
    return VmallocError(message or f"vmalloc could not allocate {size} bytes on device "
                                   f"{device_id}")


def malloc(size, device_id, stream=0):
    """Allocates ``size`` bytes on ``device_id`` for ``stream`` (an int CUstream, or a CuPy
    stream) from that device's current vmalloc allocator, as a ``cupy.cuda.MemoryPointer``.

    The memory goes back to the allocator, on the same stream, when CuPy drops the last
    reference. Needs no GPU by itself (the device is given, not looked up). Raises
    :class:`CupyOutOfMemoryError <vmalloc.OutOfMemoryError>` (also a
    ``cupy.cuda.memory.OutOfMemoryError``) when the allocator is out of memory, and
    :class:`vmalloc.VmallocError` naming the device when it has no current allocator.
    """
    memory = _cupy().cuda.memory
    if not isinstance(stream, int):
        stream = stream.ptr
    if size < 0:
        raise InvalidArgumentError(f"size {size} is negative")
    mem = memory.CFunctionAllocatorMemory(size, stream, _MALLOC, _FREE, device_id)
    if size and not mem.ptr:
        raise _failure(size, device_id)
    return memory.MemoryPointer(mem, 0)


_MALLOC = _current_allocator.function_address("vmalloc_cupy_malloc")
_FREE = _current_allocator.function_address("vmalloc_cupy_free")


class VmallocCupyAllocator:
    """CuPy's allocator callable (``size -> MemoryPointer``) over vmalloc's per-device current
    allocators, for ``cupy.cuda.set_allocator``. Each call reads CuPy's current device and
    stream; the allocation itself runs in C."""

    def __call__(self, size):
        cupy = _cupy()
        return malloc(size, cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)

    def __repr__(self):
        return "<vmalloc.cupy.VmallocCupyAllocator>"


class use_vmalloc:
    """Makes vmalloc CuPy's allocator, now; as a context manager, restores on exit.

    ``allocators`` is one :class:`vmalloc.Allocator` (serving the CUDA device of its own
    ordinal) or a ``{device_ordinal: Allocator}`` mapping. Each becomes that device's current
    vmalloc allocator (:func:`vmalloc.set_current_allocator`) and CuPy's allocator becomes a
    :class:`VmallocCupyAllocator`. :meth:`restore` (or leaving the ``with`` block) puts back
    CuPy's previous allocator and the previous current vmalloc allocators. Memory allocated
    meanwhile stays valid and goes back to the allocator that made it.

    Example::

        with vmalloc.cupy.use_vmalloc(allocator):
            y = cupy.arange(10) ** 2
    """

    def __init__(self, allocators):
        cupy = _cupy()
        mapping = as_device_map(allocators)
        self._previous_vmalloc = {}
        try:
            for device, allocator in mapping.items():
                self._previous_vmalloc[device] = _current_allocator.set_current_allocator(
                    allocator, device)
        except BaseException:
            self._restore_vmalloc()
            raise
        self._previous_cupy = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(VmallocCupyAllocator())
        self._active = True

    def _restore_vmalloc(self):
        for device, previous in self._previous_vmalloc.items():
            _current_allocator.set_current_allocator(previous, device)
        self._previous_vmalloc = {}

    def restore(self):
        """Puts back CuPy's previous allocator and the previous current vmalloc allocators.
        Calling it again does nothing."""
        if not getattr(self, "_active", False):
            return
        self._active = False
        _cupy().cuda.set_allocator(self._previous_cupy)
        self._restore_vmalloc()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


# --- out-of-core training -------------------------------------------------------------------
# CuPy has no per-op hooks, so a program marks its functions itself with the runtime's
# ``function`` blocks; these helpers make the runtime and CuPy arrays over its buffers.

def out_of_core(allocator=None, budget=None, scheduler="window", window=None, device=None,
                stream=None, persistent="auto", strict=False, recompute=False):
    """A :class:`vmalloc.offload.Runtime` for CuPy programs: over ``allocator`` (default: the
    current vmalloc allocator of ``device``, or of CuPy's current device), with CuPy's current
    stream as the compute stream; ``budget``, ``scheduler``, ``window``, ``persistent``
    (default ``"auto"``, as every driver), ``strict`` and ``recompute`` (blocks run by
    ``rt.call(fn, reads, writes)`` may be recomputed instead of swapped) as for the Runtime.
    It is a context
    manager (leaving it brings every buffer back; ``stats()`` keeps its values). Mark each
    block of work::

        with vmalloc.cupy.out_of_core(budget="12GiB") as rt:
            w = rt.allocate(4 * n * n)                      # a parameter
            with rt.iteration():
                x = rt.allocate(4 * n * n)
                with rt.function(reads=[w], writes=[x], name="init") as p:
                    vmalloc.cupy.array(p, x, (n, n))[...] = vmalloc.cupy.array(p, w, (n, n)) * 2
        print(rt.stats())

    Swaps run on the SwapManager's own streams, ordered after the compute ``stream`` (default:
    CuPy's current stream) with events.
    """
    from vmalloc.offload.runtime import Runtime

    cupy = _cupy()
    if allocator is None:
        if device is None:
            device = cupy.cuda.runtime.getDevice()
        allocator = _current_allocator.get_current_allocator(device)
        if allocator is None:
            raise VmallocError(f"device {device} has no current vmalloc allocator: pass "
                               "allocator=..., or call vmalloc.cupy.use_vmalloc(...) first")
    if stream is None:
        stream = cupy.cuda.get_current_stream().ptr
    elif not isinstance(stream, int):
        stream = stream.ptr
    return Runtime(allocator, budget=budget, scheduler=scheduler, window=window, stream=stream,
                   host_compute=False, persistent=persistent, strict=strict,
                   recompute=recompute)


def array(ptrs, buffer, shape, dtype="float32"):
    """A ``cupy.ndarray`` over a runtime buffer's memory, inside a ``rt.function`` block that
    lists it (``ptrs`` is what the block yields). The array does not own the memory; do not
    keep it past the block: the buffer may be swapped out after it."""
    cupy = _cupy()
    dtype = cupy.dtype(dtype)
    nbytes = dtype.itemsize
    for extent in shape:
        nbytes *= extent
    if nbytes > buffer.nbytes:
        raise InvalidArgumentError(
            f"an array of shape {tuple(shape)} and dtype {dtype} needs {nbytes} bytes; "
            f"buffer {buffer.id} has {buffer.nbytes}")
    rt_device = buffer.runtime.device
    device = rt_device.ordinal if rt_device is not None else 0
    mem = cupy.cuda.UnownedMemory(ptrs[buffer], buffer.nbytes, buffer, device)
    return cupy.ndarray(tuple(shape), dtype, cupy.cuda.MemoryPointer(mem, 0))
