"""vmalloc allocators as a ``cuda.core`` memory resource.

``cuda.core`` (NVIDIA's Pythonic CUDA, part of cuda-python) allocates device memory through
:class:`cuda.core.MemoryResource` objects. :class:`VmallocMemoryResource` is one over any
vmalloc allocator, so a cuda.core program allocates from vmalloc::

    from cuda.core import Device
    import vmalloc
    from vmalloc.cuda_core import VmallocMemoryResource

    dev = Device(0)
    dev.set_current()
    mr = VmallocMemoryResource(vmalloc.VirtualAllocator(vmalloc.CudaDevice(0)))
    buf = mr.allocate(1 << 20, stream=dev.default_stream)   # a cuda.core Buffer
    buf.close()                                             # back to the allocator

Needs the optional extra ``vmalloc[cuda]`` (cuda-core and cuda-bindings; Python >= 3.10).
See docs/cuda_python.rst.
"""

try:
    from cuda.core import Buffer, MemoryResource
except ImportError:  # cuda-core < 0.4 kept them under cuda.core.experimental
    try:
        from cuda.core.experimental import Buffer, MemoryResource
    except ImportError as error:
        raise ImportError(
            "vmalloc.cuda_core needs cuda-core (pip install 'vmalloc[cuda]', i.e. cuda-core "
            "and cuda-bindings, Python >= 3.10)") from error

__all__ = ["VmallocMemoryResource"]

#: cuda.h's special stream handles: the legacy default stream is vmalloc's stream 0.
_CU_STREAM_LEGACY = 0x1


def _stream(stream):
    """The CUstream handle of a cuda.core Stream (or None / an int) as vmalloc takes it."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        handle = stream
    else:
        handle = getattr(stream, "handle", stream)
        handle = int(handle) if handle is not None else 0
    return 0 if handle == _CU_STREAM_LEGACY else handle


class VmallocMemoryResource(MemoryResource):
    """A :class:`cuda.core.MemoryResource` that allocates from a vmalloc allocator.

    Args:
        allocator: any vmalloc allocator (:class:`vmalloc.VirtualAllocator`,
            :class:`vmalloc.CachingAllocator`, ...) on a :class:`vmalloc.CudaDevice`, or on a
            :class:`vmalloc.HostDevice` for host-side tests (then the memory is not
            device-accessible).

    Streams are cuda.core :class:`~cuda.core.Stream` objects (or raw ``CUstream`` ints);
    the legacy default stream is vmalloc's stream 0. A freed buffer follows the allocator's
    stream rules (freed on another stream than its allocation stream, it is reused only after
    that stream's queued work).
    """

    def __init__(self, allocator):
        import vmalloc

        self._allocator = allocator
        device = allocator.device
        self._on_gpu = isinstance(device, vmalloc.CudaDevice)
        self._device_id = device.ordinal

    @property
    def allocator(self):
        """The vmalloc allocator this resource allocates from."""
        return self._allocator

    def allocate(self, size, *, stream=None):
        """Allocates ``size`` bytes on ``stream``; returns a :class:`cuda.core.Buffer` whose
        ``close()`` (or garbage collection) gives the memory back through :meth:`deallocate`."""
        ptr = self._allocator.allocate(size, stream=_stream(stream))
        if stream is None:
            return Buffer.from_handle(ptr, size, mr=self)
        return Buffer.from_handle(ptr, size, mr=self, stream=stream)

    def deallocate(self, ptr, size, *, stream=None):
        """Gives the ``size`` bytes at ``ptr`` back to the allocator, ordered on ``stream``."""
        self._allocator.deallocate(int(ptr), size, stream=_stream(stream))

    @property
    def is_device_accessible(self):
        return self._on_gpu

    @property
    def is_host_accessible(self):
        return False

    @property
    def device_id(self):
        return self._device_id
