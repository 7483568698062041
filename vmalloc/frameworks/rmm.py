"""A vmalloc allocator as an RMM memory resource, so that RAPIDS libraries (XGBoost with
``use_rmm=True``, cuDF, cuML) allocate from vmalloc on a GPU::

    import rmm, vmalloc
    from vmalloc.frameworks import rmm as vmalloc_rmm
    allocator = vmalloc.VirtualAllocator(vmalloc.CudaDevice(0))
    rmm.mr.set_current_device_resource(vmalloc_rmm.memory_resource(allocator))

:class:`RmmCallbacks` holds the two callables of ``rmm.mr.CallbackMemoryResource``:
``allocate(size, stream)`` returning a device address and ``deallocate(ptr, size, stream)``
(older RMM releases call them without the stream; both forms work). They need no RMM, so
they are tested on the emulated device; :func:`memory_resource` imports RMM, which needs
CUDA, and raises an ImportError that says so when it cannot.

Each call crosses into Python (RMM's callback resource is its slow path, meant for exactly
this kind of adaptor): the allocator's own C++ work runs without the GIL.
"""

from __future__ import annotations

import threading
import warnings

from vmalloc.errors import InvalidArgumentError, InvalidPointerError

__all__ = ["RmmCallbacks", "memory_resource", "stream_handle"]


def stream_handle(stream):
    """The CUstream handle (an int) of what RMM passes as a stream, or None if unknown: an
    int, ``None`` (the default stream), an object with ``__cuda_stream__`` (the CUDA stream
    protocol: ``(version, handle)``), or one with an int ``ptr`` / ``cuda_stream`` /
    ``handle`` / ``value`` attribute (or method)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
            return value[1]
    for name in ("ptr", "cuda_stream", "handle", "value"):
        value = getattr(stream, name, None)
        if callable(value):
            try:
                value = value()
            except Exception:
                continue
        if isinstance(value, int):
            return value
    return None


class RmmCallbacks:
    """``allocate`` / ``deallocate`` over ``allocator`` (a :class:`vmalloc.Allocator`) with
    RMM's callback signatures, and the counts RMM itself does not keep (:meth:`stats`).

    A deallocate of a pointer this object did not hand out, or with another size than it was
    allocated with, raises :class:`vmalloc.InvalidPointerError` /
    :class:`vmalloc.InvalidArgumentError` and frees nothing. ``size == 0`` gives address 0
    (nothing allocated), as RMM's own resources do. A stream RMM passes in a form this module
    cannot read is taken as the default stream, said once (a warning) and counted
    (``unknown_streams``)."""

    def __init__(self, allocator):
        allocator.device   # an Allocator (raises AttributeError for anything else)
        self.allocator = allocator
        self._lock = threading.Lock()
        self._live = {}     # ptr -> (size, stream handle)
        self._counts = dict(allocations=0, deallocations=0, bytes_allocated=0,
                            bytes_in_use=0, peak_bytes_in_use=0, failed_allocations=0,
                            unknown_streams=0)
        self._warned = False

    def _stream(self, stream):
        handle = stream_handle(stream)
        if handle is None:
            with self._lock:
                self._counts["unknown_streams"] += 1
                warn, self._warned = not self._warned, True
            if warn:
                warnings.warn(f"vmalloc RMM callbacks: cannot read the stream of "
                              f"{type(stream).__name__}; using the default stream",
                              RuntimeWarning, stacklevel=3)
            return 0
        return handle

    def allocate(self, size, stream=None):
        """A device address of ``size`` bytes, ordered on ``stream``."""
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"allocate: size must be a non-negative int, got "
                                       f"{size!r}")
        if size == 0:
            return 0
        s = self._stream(stream)
        try:
            ptr = self.allocator.allocate(size, stream=s)
        except BaseException:
            with self._lock:
                self._counts["failed_allocations"] += 1
            raise
        with self._lock:
            self._live[ptr] = (size, s)
            c = self._counts
            c["allocations"] += 1
            c["bytes_allocated"] += size
            c["bytes_in_use"] += size
            c["peak_bytes_in_use"] = max(c["peak_bytes_in_use"], c["bytes_in_use"])
        return ptr

    def deallocate(self, ptr, size, stream=None):
        """Frees ``ptr`` (``size`` bytes, as allocated), ordered on ``stream``."""
        if ptr == 0 and size == 0:
            return
        s = self._stream(stream)
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                raise InvalidPointerError(f"deallocate: {ptr:#x} was not allocated by these "
                                          "RMM callbacks (or was freed)")
            if entry[0] != size:
                raise InvalidArgumentError(f"deallocate: {ptr:#x} has {entry[0]} bytes, RMM "
                                           f"passed size {size}")
            del self._live[ptr]
        try:
            self.allocator.deallocate(ptr, stream=s)
        except BaseException:
            with self._lock:
                self._live[ptr] = entry   # still allocated: a retry may free it
            raise
        with self._lock:
            self._counts["deallocations"] += 1
            self._counts["bytes_in_use"] -= size

    def stats(self):
        """``allocations``, ``deallocations``, ``bytes_allocated``, ``bytes_in_use``,
        ``peak_bytes_in_use``, ``failed_allocations``, ``unknown_streams``, ``live``."""
        with self._lock:
            return dict(self._counts, live=len(self._live))


def _rmm():
    try:
        import rmm
    except Exception as error:   # RMM raises more than ImportError without CUDA
        raise ImportError(f"vmalloc's RMM memory resource needs RMM with CUDA (pip install "
                          f"rmm-cu12): {type(error).__name__}: {error}") from error
    return rmm


def memory_resource(allocator, callbacks=None):
    """An ``rmm.mr.CallbackMemoryResource`` allocating from ``allocator`` (through
    ``callbacks``, an :class:`RmmCallbacks`, made here when not given; it is kept on the
    resource as ``vmalloc_callbacks`` when RMM allows an attribute there)."""
    rmm = _rmm()
    callbacks = callbacks if callbacks is not None else RmmCallbacks(allocator)
    resource = rmm.mr.CallbackMemoryResource(callbacks.allocate, callbacks.deallocate)
    try:
        resource.vmalloc_callbacks = callbacks
    except AttributeError:
        pass
    return resource
