# cython: language_level=3
"""SwapManager: pointer-stable swapping of allocations to pinned host memory and back.

A thin wrapper: the C++ core (include/vmalloc/offload/swap_manager.hpp) does the work. Every
call that may wait for the manager's lock, a stream or the device releases the GIL.
"""

from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr, static_pointer_cast
from libcpp.pair cimport pair
from libcpp.vector cimport vector

from vmalloc._core.allocator cimport Allocator, wrap_allocator
from vmalloc._core.device cimport stream_handle
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.base.types cimport unknown_size
from vmalloc._lib.offload.swap_manager cimport (
    CSwapManager,
    CSwapManagerOptions,
    CSwapState,
    CSwapStats,
    swap_state_name,
)

from vmalloc.sizes import parse_optional_size, parse_size


cdef uintptr_t _pointer(object ptr) except? 0:
    if type(ptr) is not int or ptr < 0:
        raise TypeError(f"ptr must be a non-negative int device address, got {ptr!r}")
    return ptr


cdef class SwapManager:
    """Moves live allocations of ``allocator`` to pinned host memory and back.

    Chunk-owning allocations of a :class:`vmalloc.VirtualAllocator` (requests above its
    ``small_threshold``, chunks placement) keep their pointer: their chunks are unmapped and
    remapped at the same address. Every other allocation (small blocks, packed placement,
    :class:`vmalloc.CachingAllocator`) relocates: :meth:`swap_in` returns its new pointer.
    See :doc:`swap_manager`.

    Frees: a free of a swapped-out allocation, or of one with a copy in flight, drops its
    record and host copy at once, whichever way it goes: through :meth:`deallocate`, through
    :meth:`as_allocator` (register that with a framework so that every free passes here), or
    straight through ``allocator`` (a framework's free callback on the allocator itself: the
    manager watches the allocator's frees). :meth:`discard` forgets an allocation without
    freeing it.

    Args:
        allocator: the :class:`vmalloc.Allocator` whose allocations are swapped; its device
            must be backed.
        host_capacity: the most pinned host memory held for host copies (an int or a string
            such as ``"1GiB"``), ``None`` for no limit. Beyond it a swap-out raises
            :class:`vmalloc.OutOfMemoryError` and nothing changes.
    """

    def __cinit__(self, Allocator allocator not None, host_capacity=None):
        cdef CSwapManagerOptions options
        options.host_capacity = parse_optional_size(host_capacity, "host_capacity", "no limit")
        allocator.get()  # raises for an allocator wrapper that holds none
        cdef shared_ptr[CAllocator] a = allocator.c_allocator
        cdef CSwapManager* m
        with nogil:
            m = new CSwapManager(a, options)
        self.c_manager.reset(m)
        self.allocator = allocator

    def __init__(self, Allocator allocator not None, host_capacity=None):
        refuse_second_init(self, &self.init_called)

    def __dealloc__(self):
        # The destructor waits for the device (copies in flight): without the GIL.
        with nogil:
            self.c_manager.reset()

    cdef CSwapManager* get(self) except NULL:
        # Unreachable from Python (__cinit__ builds the manager or raises): a guard for C code.
        if not self.c_manager:
            raise RuntimeError("SwapManager is not initialized")
        return self.c_manager.get()

    def swap_out(self, ptr, stream=0):
        """Starts copying the resident allocation at ``ptr`` to host, after the work queued on
        ``stream``; its device memory is released once the copy has completed (:meth:`poll`,
        :meth:`wait`, or any later call). Returns the allocation's name while it is out:
        ``ptr`` itself when the swap keeps the pointer (chunk-owning allocations of the
        virtual allocator); for a relocating swap a host address, since the allocator may give
        ``ptr`` to another allocation once the memory is released (``ptr`` keeps naming it
        while no live allocation has that address). Raises
        :class:`vmalloc.InvalidArgumentError` for an allocation that is not resident,
        :class:`vmalloc.InvalidPointerError` for an unknown pointer,
        :class:`vmalloc.OutOfMemoryError` beyond ``host_capacity``."""
        cdef uintptr_t p = _pointer(ptr)
        cdef uintptr_t s = stream_handle(stream)
        cdef CSwapManager* m = self.get()
        cdef uintptr_t key
        with nogil:
            key = m.swap_out(p, s)
        return key

    def swap_in(self, ptr, stream=0):
        """Brings the allocation at ``ptr`` back to the device, copying after the work queued
        on ``stream``; returns its pointer (the same one unless it relocates). Call
        :meth:`wait` before using it on ``stream``. An allocation still swapping out is simply
        kept (a cancel). Raises :class:`vmalloc.OutOfMemoryError` when the device memory cannot
        be had even after every in-flight swap-out released its memory: the data stays on host
        and a later call may succeed."""
        cdef uintptr_t p = _pointer(ptr)
        cdef uintptr_t s = stream_handle(stream)
        cdef CSwapManager* m = self.get()
        cdef uintptr_t r
        with nogil:
            r = m.swap_in(p, s)
        return r

    def wait(self, ptr, stream=0):
        """Swapping in: ``stream`` waits (on the device) for the copy. Swapping out: the host
        waits for the copy and the device memory is released. Otherwise nothing."""
        cdef uintptr_t p = _pointer(ptr)
        cdef uintptr_t s = stream_handle(stream)
        cdef CSwapManager* m = self.get()
        with nogil:
            m.wait(p, s)

    def state(self, ptr):
        """``"resident"``, ``"swapping_out"``, ``"on_host"`` or ``"swapping_in"``."""
        cdef uintptr_t p = _pointer(ptr)
        cdef CSwapManager* m = self.get()
        cdef CSwapState st
        with nogil:
            st = m.state(p)
        return swap_state_name(st).decode()

    def deallocate(self, ptr, stream=0, nbytes=None):
        """Frees the allocation at ``ptr`` (its pointer, or its name while out as
        :meth:`swap_out` returned it) in any state, waiting for a copy in flight, and drops its
        host copy; a resident untracked allocation is passed to the allocator. ``nbytes``,
        when given, must be the size asked for."""
        cdef uintptr_t p = _pointer(ptr)
        cdef uintptr_t s = stream_handle(stream)
        cdef size_t n = unknown_size if nbytes is None else parse_size(nbytes, "nbytes")
        cdef CSwapManager* m = self.get()
        with nogil:
            m.deallocate(p, n, s)

    def discard(self, ptr):
        """Forgets the allocation named ``ptr`` (its pointer, or its name while out) without
        freeing it: its record and host copy go (after a copy in flight has finished), the
        device memory stays with its owner, who frees it through the allocator (or has). The
        call for a framework that freed, or is about to free, memory the manager swapped
        (``Runtime.forget``). Returns True if the manager tracked it, False (nothing changed)
        otherwise: a free through the allocator has already forgotten it.

        A relocating allocation forgotten while on host has no device memory left, and its
        data is gone; a chunk-owning one stays live in the allocator, unbacked, until its
        owner frees it."""
        cdef uintptr_t p = _pointer(ptr)
        cdef CSwapManager* m = self.get()
        cdef bint r
        with nogil:
            r = m.discard(p)
        return r

    def as_allocator(self):
        """The manager as a :class:`vmalloc.Allocator` over ``allocator`` (RMM's adaptor
        pattern), for any vmalloc API that takes one (``vmalloc.torch.use_vmalloc``,
        ``vmalloc.set_current_allocator``): allocations come from ``allocator``, and every free
        goes through the manager, which also resolves the names of relocated allocations on
        host. Its stats are the allocator's. It keeps the manager alive."""
        self.get()
        return wrap_allocator(static_pointer_cast[CAllocator, CSwapManager](self.c_manager),
                              self.allocator.device)

    def poll(self):
        """Releases the memory of completed swap-outs and the host copies of completed
        swap-ins, without blocking; returns how many allocations changed state."""
        cdef CSwapManager* m = self.get()
        cdef size_t n
        with nogil:
            n = m.poll()
        return n

    def swap_out_all(self, stream=0):
        """Swaps out every resident live allocation of the allocator (vLLM's sleep mode);
        returns ``{pointer: key}`` for those it started (the key as :meth:`swap_out` returns
        it). On error none of them stays swapping out."""
        cdef uintptr_t s = stream_handle(stream)
        cdef CSwapManager* m = self.get()
        cdef vector[pair[uintptr_t, uintptr_t]] keys
        with nogil:
            m.swap_out_all(s, &keys)
        return {p.first: p.second for p in keys}

    def swap_in_all(self, stream=0):
        """Swaps every swapped-out allocation back in, oldest swap-out first; returns
        ``{key: new}``: the name each has while out (as :meth:`swap_out` and
        :meth:`swap_out_all` return it) and its pointer now (equal unless relocated). Stops at the first error: the
        exception's ``moved`` attribute is the ``{old: new}`` of those swapped in before it
        (they stay swapping in); the others stay swapped out."""
        cdef uintptr_t s = stream_handle(stream)
        cdef CSwapManager* m = self.get()
        cdef vector[pair[uintptr_t, uintptr_t]] moved
        try:
            with nogil:
                m.swap_in_all(s, moved)
        except Exception as error:
            error.moved = {p.first: p.second for p in moved}
            raise
        return {p.first: p.second for p in moved}

    def allocate(self, nbytes, stream=0):
        """``allocator.allocate(nbytes, stream)`` (relocated allocations on host are named by
        host addresses, so any device address is unambiguous)."""
        cdef size_t n = parse_size(nbytes, "nbytes")
        cdef uintptr_t s = stream_handle(stream)
        cdef CSwapManager* m = self.get()
        cdef uintptr_t p
        with nogil:
            p = m.allocate(n, s)
        return p

    def relocates(self, ptr):
        """True if swapping the allocation at ``ptr`` changes its pointer."""
        cdef uintptr_t p = _pointer(ptr)
        cdef CSwapManager* m = self.get()
        cdef bint r
        with nogil:
            r = m.relocates(p)
        return r

    def release_cached_host(self):
        """Frees the cached pinned host blocks; returns the bytes freed."""
        cdef CSwapManager* m = self.get()
        cdef size_t n
        with nogil:
            n = m.release_cached_host()
        return n

    @property
    def streams(self):
        """The manager's copy streams: ``(device_to_host, host_to_device)``."""
        cdef CSwapManager* m = self.get()
        return (m.d2h_stream(), m.h2d_stream())

    def stats(self):
        """A dict of counters: swap_outs, bytes_swapped_out, swap_ins, bytes_swapped_in,
        cancelled_swap_outs, relocations, relocating_swap_outs, oom_retries,
        swap_in_failures, host_waits, wait_seconds, swapping_out / on_host / swapping_in (now),
        events_created, and the host staging pool's host_capacity_bytes,
        host_bytes_in_use, peak_host_bytes_in_use, host_bytes_cached, host_blocks_in_use,
        host_blocks_cached, host_alloc_calls, host_free_calls, host_reuses."""
        cdef CSwapManager* m = self.get()
        cdef CSwapStats s
        with nogil:
            s = m.swap_stats()
        return {
            "swap_outs": s.swap_outs,
            "bytes_swapped_out": s.bytes_swapped_out,
            "swap_ins": s.swap_ins,
            "bytes_swapped_in": s.bytes_swapped_in,
            "cancelled_swap_outs": s.cancelled_swap_outs,
            "relocations": s.relocations,
            "relocating_swap_outs": s.relocating_swap_outs,
            "oom_retries": s.oom_retries,
            "swap_in_failures": s.swap_in_failures,
            "host_waits": s.host_waits,
            "wait_seconds": s.wait_seconds,
            "swapping_out": s.swapping_out,
            "on_host": s.on_host,
            "swapping_in": s.swapping_in,
            "events_created": s.events_created,
            "host_capacity_bytes": s.host.capacity_bytes,
            "host_bytes_in_use": s.host.in_use_bytes,
            "peak_host_bytes_in_use": s.host.peak_in_use_bytes,
            "host_bytes_cached": s.host.cached_bytes,
            "host_blocks_in_use": s.host.blocks_in_use,
            "host_blocks_cached": s.host.blocks_cached,
            "host_alloc_calls": s.host.host_alloc_calls,
            "host_free_calls": s.host.host_free_calls,
            "host_reuses": s.host.reuses,
        }

    def __repr__(self):
        if not self.c_manager:
            return "<SwapManager (uninitialized)>"
        s = self.stats()
        return (f"<SwapManager over {self.allocator!r}: {s['swapping_out']} swapping out, "
                f"{s['on_host']} on host, {s['swapping_in']} swapping in>")
