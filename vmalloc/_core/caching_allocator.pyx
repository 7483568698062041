# cython: language_level=3
"""CachingAllocator: the best-fit caching baseline (PyTorch's CUDACachingAllocator policy)."""

from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr, static_pointer_cast
from libcpp.vector cimport vector

from vmalloc._core.allocator cimport Allocator
from vmalloc._core.device cimport Device, stream_handle
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.alloc.caching_allocator cimport (
    CBlockState,
    CCachingAllocator,
    CCachingAllocatorOptions,
    CCachingBlockInfo,
    CCachingSegmentInfo,
    CCachingSegmentStats,
    caching_policy_name,
    caching_unlimited,
    parse_caching_policy,
)
from vmalloc._lib.device.device cimport CDevice

from vmalloc.errors import InvalidArgumentError
from vmalloc.sizes import parse_optional_size, parse_size


_STATE_NAMES = {
    <int>CBlockState.allocated: "allocated",
    <int>CBlockState.waiting: "waiting",
    <int>CBlockState.free: "free",
}


cdef class CachingAllocator(Allocator):
    """The best-fit caching allocator of PyTorch (``CUDACachingAllocator``), the baseline the
    virtual allocator is measured against.

    Requests round up to 512 B; those of at most 1 MiB are carved from 2 MiB segments (the
    small pool), those below 10 MiB from 20 MiB segments, larger ones get a segment of the
    request rounded up to 2 MiB. Free blocks are cached per stream, reused best fit, split and
    merged within their segment, and given back only whole segments at a time
    (:meth:`release_cached`, or when the device runs out of memory). See
    :doc:`caching_allocator` for every rule.

    Args:
        device: the :class:`vmalloc.Device` to allocate on.
        policy: ``"pytorch"`` (default), ``"nnabla"`` (nnabla's
            ``CachingAllocatorWithBuckets``) or ``"cupy"`` (CuPy's ``MemoryPool``).
        max_split_size: PyTorch's ``max_split_size_mb`` in bytes (an int or a string such
            as ``"64MiB"``; at least 20 MiB); None (default) = unlimited. Blocks this large
            are never split and never serve smaller requests.
        max_non_split_rounding_size: PyTorch's ``max_non_split_rounding_mb`` in bytes
            (default 20 MiB, at least 20 MiB): a request of at least ``max_split_size`` only
            takes a cached block smaller than the request plus this.
        budget: most bytes of segments to hold at once (like PyTorch's
            ``set_per_process_memory_fraction`` or CuPy's ``set_limit``); None = only the
            device's capacity limits.
        expandable_segments: PyTorch's ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
            (``"pytorch"`` policy only): one reserved address range per stream and pool,
            grown and shrunk in pages of 2 MiB (small pool) / 20 MiB (large pool) instead of
            one device allocation per segment. See :doc:`caching_allocator`.

    Raises:
        vmalloc.InvalidArgumentError: an unknown policy or an invalid option (the message
            names it).
    """

    def __cinit__(self, Device device not None, policy="pytorch", max_split_size=None,
                  max_non_split_rounding_size=None, budget=None, expandable_segments=False):
        cdef CCachingAllocatorOptions options
        cdef shared_ptr[CCachingAllocator] allocator
        cdef shared_ptr[CDevice] c_device
        device.get()  # raises for a device that holds none
        c_device = device.c_device
        if not isinstance(policy, str):
            raise InvalidArgumentError(
                f"policy must be 'pytorch', 'nnabla' or 'cupy', got {policy!r}")
        options.policy = parse_caching_policy(policy.encode())
        if max_split_size is not None:
            options.max_split_size = parse_size(max_split_size, "max_split_size")
        if max_non_split_rounding_size is not None:
            options.max_non_split_rounding_size = parse_size(
                max_non_split_rounding_size, "max_non_split_rounding_size")
        options.budget = parse_optional_size(budget, "budget", "no budget")
        options.expandable_segments = True if expandable_segments else False
        with nogil:
            allocator = shared_ptr[CCachingAllocator](new CCachingAllocator(c_device, options))
        self.c_allocator = static_pointer_cast[CAllocator, CCachingAllocator](allocator)
        self.device = device

    def __init__(self, Device device not None, policy="pytorch", max_split_size=None,
                 max_non_split_rounding_size=None, budget=None, expandable_segments=False):
        refuse_second_init(self, &self.init_called)

    cdef CCachingAllocator* caching(self) except NULL:
        return <CCachingAllocator*>self.get()

    @property
    def policy(self):
        """The policy preset, one of ``"pytorch"``, ``"nnabla"`` and ``"cupy"``."""
        return caching_policy_name(self.caching().options().policy).decode()

    @property
    def max_split_size(self):
        """``max_split_size`` in bytes, or None when unlimited."""
        cdef size_t v = self.caching().options().max_split_size
        return None if v == caching_unlimited else v

    @property
    def max_non_split_rounding_size(self):
        """``max_non_split_rounding_size`` in bytes."""
        return self.caching().options().max_non_split_rounding_size

    @property
    def expandable_segments(self):
        """Whether segments are PyTorch's expandable segments (``expandable_segments:True``)."""
        return self.caching().options().expandable_segments

    @property
    def budget(self):
        """The most bytes of segments held at once, or None."""
        cdef size_t v = self.caching().options().budget
        return None if v == 0 else v

    def record_stream(self, uintptr_t ptr, stream):
        """PyTorch's ``Tensor.record_stream``: the live allocation at ``ptr`` is also used by
        work on ``stream``. When it is freed, it returns to its pool only once the work
        queued on ``stream`` before the free has completed. Raises
        :class:`vmalloc.InvalidPointerError` for a pointer that is not live and
        :class:`vmalloc.DeviceError` for an unknown stream (checked at once, by recording an
        event on it, so that the free cannot fail later)."""
        cdef CCachingAllocator* a = self.caching()
        cdef uintptr_t s = stream_handle(stream)
        with nogil:
            a.record_stream(ptr, s)

    def round_size(self, nbytes):
        """The block size a request of ``nbytes`` is rounded to under this policy."""
        cdef CCachingAllocator* a = self.caching()
        cdef size_t n = parse_size(nbytes, "nbytes")
        if n == 0:
            return 0
        return a.round_size(n)

    def segment_size(self, nbytes):
        """The size of the segment a cache miss for ``nbytes`` creates (rounded up to the
        device granularity)."""
        cdef CCachingAllocator* a = self.caching()
        cdef size_t n = parse_size(nbytes, "nbytes")
        if n == 0:
            return 0
        return a.segment_size(a.round_size(n))

    def pool_of(self, nbytes):
        """``"small"`` or ``"large"``: the pool that serves a request of ``nbytes``."""
        cdef CCachingAllocator* a = self.caching()
        cdef size_t n = parse_size(nbytes, "nbytes")
        return "small" if n and a.is_small(a.round_size(n)) else "large"

    def segment_stats(self):
        """Detail beyond :meth:`stats`, as a dict: segments and their bytes by pool
        (``small_segments``, ``large_segments``, ``small_segment_bytes``,
        ``large_segment_bytes``), blocks (``live_blocks``, ``free_blocks``, ``free_bytes``,
        ``largest_free_block``, ``waiting_blocks`` and ``waiting_bytes`` for frees waiting on
        other streams), ``unsplit_free_segments`` (what :meth:`release_cached` would free),
        and counters since construction: ``segments_created``, ``segments_released``,
        ``alloc_retries`` (allocations that had to flush the cache) and ``cache_flushes``."""
        cdef CCachingAllocator* a = self.caching()
        cdef CCachingSegmentStats s
        with nogil:
            s = a.segment_stats()
        return {
            "small_segments": s.small_segments,
            "large_segments": s.large_segments,
            "small_segment_bytes": s.small_segment_bytes,
            "large_segment_bytes": s.large_segment_bytes,
            "live_blocks": s.live_blocks,
            "free_blocks": s.free_blocks,
            "free_bytes": s.free_bytes,
            "largest_free_block": s.largest_free_block,
            "waiting_blocks": s.waiting_blocks,
            "waiting_bytes": s.waiting_bytes,
            "unsplit_free_segments": s.unsplit_free_segments,
            "segments_created": s.segments_created,
            "segments_released": s.segments_released,
            "alloc_retries": s.alloc_retries,
            "cache_flushes": s.cache_flushes,
        }

    def snapshot(self):
        """Every segment in address order, like ``torch.cuda.memory_snapshot()``: a list of
        dicts with ``address``, ``size``, ``pool`` (``"small"``/``"large"``), ``stream`` and
        ``blocks``, each block a dict with ``address``, ``size``, ``requested`` (0 unless
        allocated), ``stream`` and ``state`` (``"allocated"``, ``"waiting"`` for a free
        waiting on another stream's work, or ``"free"``)."""
        cdef CCachingAllocator* a = self.caching()
        cdef vector[CCachingSegmentInfo] segments
        with nogil:
            segments = a.snapshot()
        cdef CCachingSegmentInfo seg
        cdef CCachingBlockInfo b
        result = []
        for seg in segments:
            blocks = []
            for b in seg.blocks:
                blocks.append({"address": b.ptr, "size": b.size, "requested": b.requested,
                               "stream": b.stream, "state": _STATE_NAMES[<int>b.state]})
            result.append({"address": seg.ptr, "size": seg.size,
                           "pool": "small" if seg.small else "large",
                           "stream": seg.stream, "blocks": blocks})
        return result
