# cython: language_level=3
"""The virtual-addressing allocator: physical chunks mapped into contiguous reserved ranges."""

from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr, static_pointer_cast

from vmalloc._core.allocator cimport Allocator
from vmalloc._core.device cimport Device, stream_handle
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.alloc.packed_virtual_allocator cimport (
    CPackedVirtualAllocator,
    PackedStats,
    PackedVirtualAllocatorOptions,
    packed_default_small_threshold,
)
from vmalloc._lib.alloc.chunk_stats cimport ChunkStats
from vmalloc._lib.alloc.virtual_allocator cimport (
    CVirtualAllocator,
    VirtualAllocatorOptions,
    default_small_threshold,
)
from vmalloc._lib.device.device cimport CDevice

from vmalloc.errors import InvalidArgumentError
from vmalloc.sizes import parse_optional_size, parse_size

# PhysicalChunkPool has a module of its own; it is still importable from here, where it was.
from vmalloc._core.physical_chunk_pool import PhysicalChunkPool  # noqa: F401


#: The placement policies of :class:`VirtualAllocator`.
PLACEMENTS = ("chunks", "packed")


cdef class VirtualAllocator(Allocator):
    """The paper's virtual-addressing allocator (Hayakawa & Narihira, section 4).

    A request of ``n`` bytes gets ``ceil(n / chunk_size)`` physical chunks, any chunks, mapped
    into one contiguous reserved virtual range, so physical memory never fragments: a request
    succeeds whenever enough chunks are free anywhere. Freed ranges stay mapped and are reused
    (best fit by chunk count, split and merged for free), so a repeated training step makes no
    memory-management driver call after warm-up. Requests of at most ``small_threshold`` bytes
    are sub-allocated in 512-byte blocks inside chunks. See :doc:`virtual_allocator`.

    Args:
        device: the :class:`vmalloc.Device` to allocate on.
        chunk_size: bytes per physical chunk (int or a string such as ``"2MiB"``), a multiple
            of the device granularity. ``None``: 2 MiB rounded up to the granularity.
        budget: the most bytes of chunks held at once (at least one chunk), or ``None`` for no
            budget beyond the device's capacity.
        small_threshold: requests of at most this many bytes are sub-allocated; at most
            ``chunk_size``; 0 disables sub-allocation. ``None``: ``chunk_size // 2``. With
            ``placement="packed"``: requests of at most this many bytes are packed in
            reservations of their own (0: all together); ``None``: 1 MiB.
        placement: ``"chunks"`` (the default): each request owns ``ceil(n / chunk_size)``
            whole chunks. ``"packed"``: requests are packed back to back at 512-byte
            granularity in large reservations and chunks back only the slots live blocks
            overlap, so tensors share chunks (see "Packed placement" in
            :doc:`virtual_allocator`).
        reservation_size: ``placement="packed"`` only: virtual bytes per reservation
            (``None``: 1 GiB); a larger request gets a reservation of its own size.
        steal_before_create: whether, on a miss, chunks are stolen from free mapped memory
            whose frees' work is done before new ones are created. ``True`` keeps reserved
            memory near the peak of what is in use; ``False`` creates new chunks first and
            steals only at the budget or the capacity, so that what a repeated pattern
            touches stays mapped and the pattern makes no driver call after warm-up (the
            smallest device that runs a workload is the same). ``None``: ``False`` with
            chunks placement (it keeps the zero-call steady state), ``True`` with packed
            placement. See "Misses" and "Steal first, or create first" in
            :doc:`virtual_allocator`.
        remap_slack: ``placement="packed"`` with stealing first only: how far above the peak
            of chunk slots live blocks touched at once the chunks held may grow (a fraction
            in [0, 1]) so that a repeating step whose blocks touch more slots over the step
            than at once stops remapping chunks: a slot that was stolen and is needed again
            gets a new chunk instead. ``None`` or 0: always steal, holding the least memory
            (the utilization target); 1/16 settles typical training steps to no driver call
            after warm-up for at most 1/16 more memory held. See "Repeating steps" in
            :doc:`virtual_allocator`.

    Raises:
        vmalloc.InvalidArgumentError: for a chunk size that is zero or not a multiple of the
            granularity, a budget below one chunk, a threshold above a chunk (chunks
            placement), an unknown placement, ``reservation_size`` or ``remap_slack`` with
            chunks placement, or a ``remap_slack`` outside [0, 1].
        TypeError: for a ``steal_before_create`` that is not a bool.
    """

    def __cinit__(self, Device device not None, chunk_size=None, budget=None,
                  small_threshold=None, placement="chunks", reservation_size=None,
                  steal_before_create=None, remap_slack=None):
        device.get()  # raises for a device that holds none
        if placement not in PLACEMENTS:
            raise InvalidArgumentError(
                f"placement must be one of {', '.join(map(repr, PLACEMENTS))}, "
                f"got {placement!r}")
        if placement == "packed":
            self.build_packed(device, chunk_size, budget, small_threshold, reservation_size,
                              True if steal_before_create is None else steal_before_create,
                              remap_slack)
            return
        if reservation_size is not None:
            raise InvalidArgumentError('reservation_size applies to placement="packed" only')
        if remap_slack is not None:
            raise InvalidArgumentError('remap_slack applies to placement="packed" only')
        self.build_chunks(device, chunk_size, budget, small_threshold,
                          False if steal_before_create is None else steal_before_create)

    def __init__(self, Device device not None, chunk_size=None, budget=None,
                 small_threshold=None, placement="chunks", reservation_size=None,
                 steal_before_create=None, remap_slack=None):
        refuse_second_init(self, &self.init_called)

    def __dealloc__(self):
        # Allocator.__dealloc__ (run after this) drops the last reference without the GIL.
        with nogil:
            self.c_virtual.reset()
            self.c_packed.reset()

    cdef int build_chunks(self, Device device, chunk_size, budget, small_threshold,
                          steal_before_create) except -1:
        cdef VirtualAllocatorOptions options
        options.chunk_size = parse_optional_size(chunk_size, "chunk_size", "the default")
        options.budget = parse_optional_size(budget, "budget", "no budget")
        options.small_threshold = (default_small_threshold if small_threshold is None
                                   else parse_size(small_threshold, "small_threshold"))
        options.steal_before_create = _flag(steal_before_create, "steal_before_create")
        cdef shared_ptr[CDevice] c_device = device.c_device
        cdef shared_ptr[CVirtualAllocator] created
        with nogil:
            created = CVirtualAllocator.create(c_device, options)
        self.placement = "chunks"
        self.c_virtual = created
        self.c_allocator = static_pointer_cast[CAllocator, CVirtualAllocator](self.c_virtual)
        self.device = device
        return 0

    cdef int build_packed(self, Device device, chunk_size, budget, small_threshold,
                          reservation_size, steal_before_create, remap_slack) except -1:
        cdef PackedVirtualAllocatorOptions options
        options.chunk_size = parse_optional_size(chunk_size, "chunk_size", "the default")
        options.budget = parse_optional_size(budget, "budget", "no budget")
        options.small_threshold = (packed_default_small_threshold if small_threshold is None
                                   else parse_size(small_threshold, "small_threshold"))
        options.reservation_size = parse_optional_size(reservation_size, "reservation_size",
                                                       "1 GiB")
        options.steal_before_create = _flag(steal_before_create, "steal_before_create")
        if remap_slack is not None:
            options.remap_slack = float(remap_slack)  # checked in C++ (NaN, range)
        cdef shared_ptr[CDevice] c_device = device.c_device
        cdef shared_ptr[CPackedVirtualAllocator] created
        with nogil:
            created = CPackedVirtualAllocator.create(c_device, options)
        self.placement = "packed"
        self.c_packed = created
        self.c_allocator = static_pointer_cast[CAllocator, CPackedVirtualAllocator](
            self.c_packed)
        self.device = device
        return 0

    @property
    def chunk_size(self):
        """Bytes per physical chunk."""
        self.get()
        if self.c_packed:
            return self.c_packed.get().chunk_size()
        return self.c_virtual.get().chunk_size()

    @property
    def small_threshold(self):
        """Requests of at most this many bytes are sub-allocated (0: none are); with packed
        placement, packed apart from larger ones."""
        self.get()
        if self.c_packed:
            return self.c_packed.get().small_threshold()
        return self.c_virtual.get().small_threshold()

    @property
    def reservation_size(self):
        """Virtual bytes per reservation (packed placement), or None (chunks placement)."""
        self.get()
        if self.c_packed:
            return self.c_packed.get().reservation_size()
        return None

    @property
    def steal_before_create(self):
        """Whether free mapped chunks are stolen before new ones are created on a miss."""
        self.get()
        if self.c_packed:
            return self.c_packed.get().steal_before_create()
        return self.c_virtual.get().steal_before_create()

    @property
    def remap_slack(self):
        """Packed placement's ``remap_slack`` (a float); ``None`` with chunks placement."""
        self.get()
        if self.c_packed:
            return self.c_packed.get().remap_slack()
        return None

    @property
    def budget(self):
        """The most bytes of chunks held at once, or None."""
        self.get()
        cdef size_t b = (self.c_packed.get().budget() if self.c_packed
                         else self.c_virtual.get().budget())
        return None if b == 0 else b

    def packed_stats(self):
        """Detail of packed placement beyond :meth:`stats`, as a dict.

        ``chunks_held`` (= ``chunks_live + chunks_free_mapped + chunks_in_pool``),
        ``peak_chunks_held``, ``chunks_live`` (mapped slots some live block overlaps),
        ``chunks_free_mapped`` (mapped slots no live block overlaps: reusable in place or
        stolen), ``chunks_in_pool`` (unmapped, cached), ``free_chunks``, ``live_blocks``,
        ``free_holes``, ``hole_bytes`` (free bytes inside reservations), ``reservations``,
        ``reserved_address_bytes``, ``chunks_created``, ``chunks_released``,
        ``chunks_stolen``, ``fresh_placements`` (blocks moved to a fresh chunk-aligned
        reservation under memory pressure), ``events_created``, ``multi_stream``,
        ``chunk_size``, ``small_threshold``, ``reservation_size``, ``steal_before_create``,
        ``remap_slack``, ``budget_bytes``.

        Raises:
            vmalloc.InvalidArgumentError: with ``placement="chunks"``.
        """
        self.get()
        if not self.c_packed:
            raise InvalidArgumentError(
                'packed_stats() needs placement="packed"; use chunk_stats()')
        cdef CPackedVirtualAllocator* packed = self.c_packed.get()
        cdef PackedStats s
        with nogil:
            s = packed.packed_stats()
        return {
            "chunk_size": s.chunk_size,
            "small_threshold": s.small_threshold,
            "reservation_size": s.reservation_size,
            "steal_before_create": s.steal_before_create,
            "remap_slack": s.remap_slack,
            "budget_bytes": s.budget_bytes,
            "chunks_held": s.chunks_held,
            "peak_chunks_held": s.peak_chunks_held,
            "chunks_live": s.chunks_live,
            "chunks_free_mapped": s.chunks_free_mapped,
            "chunks_in_pool": s.chunks_in_pool,
            "free_chunks": s.free_chunks,
            "live_blocks": s.live_blocks,
            "free_holes": s.free_holes,
            "hole_bytes": s.hole_bytes,
            "reservations": s.reservations,
            "reserved_address_bytes": s.reserved_address_bytes,
            "chunks_created": s.chunks_created,
            "chunks_released": s.chunks_released,
            "chunks_stolen": s.chunks_stolen,
            "fresh_placements": s.fresh_placements,
            "events_created": s.events_created,
            "multi_stream": s.multi_stream,
        }

    def chunk_stats(self):
        """Detail beyond :meth:`stats`, in chunks, as a dict.

        ``chunks_held`` (= ``chunks_live + chunks_cached + chunks_in_arenas +
        chunks_in_pool``), ``peak_chunks_held``, ``chunks_live`` (mapped in live allocations),
        ``chunks_cached`` (mapped in free cached ranges), ``chunks_in_arenas`` (sub-allocated
        chunks), ``chunks_in_pool`` (unmapped, cached), ``free_chunks`` (cached + in pool +
        arena chunks without live blocks: what any request may use), ``arena_chunks_empty``,
        ``cached_ranges``, ``live_ranges``, ``live_blocks``, ``free_blocks``,
        ``arena_free_bytes``, ``reservations``, ``reserved_address_bytes``,
        ``chunks_created``, ``chunks_released``, ``chunks_stolen`` (remapped from cached
        ranges), ``events_created``, ``multi_stream``, ``chunk_size``, ``small_threshold``,
        ``budget_bytes``.

        With ``placement="packed"`` the same keys describe slots: ``chunks_live`` are mapped
        slots some live block overlaps, ``chunks_cached`` mapped slots none does,
        ``cached_ranges`` the free holes, ``live_ranges`` the live blocks; there are no
        arenas (``chunks_in_arenas``, ``live_blocks``, ``free_blocks`` are 0). See
        :meth:`packed_stats`.
        """
        self.get()
        cdef CPackedVirtualAllocator* packed = self.c_packed.get()
        cdef CVirtualAllocator* chunks = self.c_virtual.get()
        cdef ChunkStats s
        with nogil:
            if packed != NULL:
                s = packed.chunk_stats()
            else:
                s = chunks.chunk_stats()
        return {
            "chunk_size": s.chunk_size,
            "small_threshold": s.small_threshold,
            "budget_bytes": s.budget_bytes,
            "chunks_held": s.chunks_held,
            "peak_chunks_held": s.peak_chunks_held,
            "chunks_live": s.chunks_live,
            "chunks_cached": s.chunks_cached,
            "chunks_in_arenas": s.chunks_in_arenas,
            "chunks_in_pool": s.chunks_in_pool,
            "free_chunks": s.free_chunks,
            "arena_chunks_empty": s.arena_chunks_empty,
            "cached_ranges": s.cached_ranges,
            "live_ranges": s.live_ranges,
            "live_blocks": s.live_blocks,
            "free_blocks": s.free_blocks,
            "arena_free_bytes": s.arena_free_bytes,
            "reservations": s.reservations,
            "reserved_address_bytes": s.reserved_address_bytes,
            "chunks_created": s.chunks_created,
            "chunks_released": s.chunks_released,
            "chunks_stolen": s.chunks_stolen,
            "unbacked_ranges": s.unbacked_ranges,
            "chunks_unbacked": s.chunks_unbacked,
            "unbacked_bytes": s.unbacked_bytes,
            "events_created": s.events_created,
            "multi_stream": s.multi_stream,
        }

    # --- the swap primitives (chunks placement; see :doc:`swap_manager`) ---

    cdef CVirtualAllocator* chunks_only(self, what) except NULL:
        self.get()
        if not self.c_virtual:
            raise InvalidArgumentError(
                f'{what} applies to placement="chunks" only: packed allocations share chunks '
                f'(the SwapManager relocates them)')
        return self.c_virtual.get()

    def owns_chunks(self, ptr):
        """True if the live allocation at ``ptr`` owns whole chunks (above ``small_threshold``,
        chunks placement), so that :meth:`unmap_backing` can unmap it alone."""
        if self.c_packed:
            self.allocation_size(ptr)  # InvalidPointerError for a pointer not live here
            return False
        cdef CVirtualAllocator* a = self.chunks_only("owns_chunks")
        cdef uint64_t p = ptr
        cdef bool owns
        with nogil:  # it takes the allocator's lock: never wait for it holding the GIL
            owns = a.owns_chunks(p)
        return owns

    def unmap_backing(self, ptr, stream=0, synchronize=True):
        """Unmaps the chunks of the live chunk-owning allocation at ``ptr`` (they return to
        the pool); the allocation stays live at the same address, unbacked. With
        ``synchronize`` the host first waits for ``stream``'s work."""
        cdef CVirtualAllocator* a = self.chunks_only("unmap_backing")
        cdef uint64_t p = ptr
        cdef uint64_t s = stream_handle(stream)
        cdef bool sync = True if synchronize else False
        with nogil:
            a.unmap_backing(p, s, sync)

    def map_backing(self, ptr, stream=0):
        """Maps chunks again under the unbacked allocation at ``ptr`` (same address, contents
        undefined). Raises :class:`vmalloc.OutOfMemoryError` with nothing changed."""
        cdef CVirtualAllocator* a = self.chunks_only("map_backing")
        cdef uint64_t p = ptr
        cdef uint64_t s = stream_handle(stream)
        with nogil:
            a.map_backing(p, s)


cdef bool _flag(value, what) except *:
    # Only a real bool: a truthy string such as "false" must not turn the policy on.
    if value is not True and value is not False:
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return value
