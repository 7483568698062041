# cython: language_level=3
"""The Python face of the allocator interface, shared by every vmalloc allocator."""

from libc.stdint cimport uintptr_t
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string

from vmalloc._core.device cimport Device, stream_handle
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.base.stats cimport CStats
from vmalloc._lib.base.types cimport unknown_size

from vmalloc.errors import OutOfMemoryError
from vmalloc.sizes import MAX_SIZE, parse_size
from vmalloc._core.stats import Stats


cdef size_t _MAX_REQUEST = MAX_SIZE

# Passed by wrap_allocator to Allocator.__new__: the only way to make a plain Allocator, which
# Python code cannot reach (a cdef module global is not a module attribute).
cdef object _WRAP = object()


cdef object stats_from_c(const CStats& s):
    return Stats(
        requested_bytes=s.requested_bytes,
        peak_requested_bytes=s.peak_requested_bytes,
        reserved_bytes=s.reserved_bytes,
        peak_reserved_bytes=s.peak_reserved_bytes,
        allocated_bytes=s.allocated_bytes,
        peak_allocated_bytes=s.peak_allocated_bytes,
        internal_fragmentation_bytes=s.internal_fragmentation_bytes,
        peak_internal_fragmentation_bytes=s.peak_internal_fragmentation_bytes,
        cached_bytes=s.cached_bytes,
        live_allocations=s.live_allocations,
        peak_live_allocations=s.peak_live_allocations,
        total_allocations=s.total_allocations,
        total_deallocations=s.total_deallocations,
        out_of_memory_count=s.out_of_memory_count,
    )


cdef Allocator wrap_allocator(shared_ptr[CAllocator] c_allocator, Device device):
    if not c_allocator or device is None:
        raise RuntimeError("wrap_allocator: no C++ allocator or no device to wrap")
    cdef Allocator allocator = Allocator.__new__(Allocator, _WRAP)
    allocator.c_allocator = c_allocator
    allocator.device = device
    allocator.init_called = True
    return allocator


cdef class Allocator:
    """Base of every vmalloc allocator: allocate / deallocate device memory on a stream.

    Not constructed directly: ``Allocator()`` raises TypeError. Thread-safe. Sizes are ints
    or strings such as ``"2MiB"``; streams are ints (``CUstream`` handles, 0 = default) or
    CuPy/PyTorch stream objects.
    """

    # A subclass builds its C++ allocator in __cinit__, so a wrapper that exists holds one
    # (even one made with cls.__new__(cls)); __init__ only refuses to be called a second time.

    def __cinit__(self, *args, **kwargs):
        # Runs before the subclass's __cinit__, with its arguments. A plain Allocator would
        # hold no allocator: only wrap_allocator makes one.
        if type(self) is Allocator and not (len(args) == 1 and args[0] is _WRAP
                                            and not kwargs):
            raise TypeError("vmalloc.Allocator cannot be constructed: it is the base of "
                            "VirtualAllocator, CachingAllocator and LoggingAllocator; "
                            "construct one of those")

    # Every entry point releases the GIL around the C++ call: the allocator's mutex may be
    # held by a thread that waits for the device (a synchronize inside allocate), and a
    # thread waiting for that mutex with the GIL held would stop the thread that makes the
    # device go on (e.g. one releasing a stream hold) from running.

    cdef CAllocator* get(self) except NULL:
        # Only a Python subclass that builds no allocator reaches the error.
        if not self.c_allocator:
            raise RuntimeError(f"{type(self).__name__} is not initialized: it holds no "
                               f"allocator (subclass one of vmalloc's allocators, not "
                               f"Allocator)")
        return self.c_allocator.get()

    def __dealloc__(self):
        # The last reference destroys the allocator, which synchronizes the device.
        with nogil:
            self.c_allocator.reset()

    @property
    def name(self):
        """``"virtual"``, ``"caching"``, ..."""
        cdef CAllocator* a = self.get()
        cdef string n
        with nogil:
            n = a.name()
        return n.decode()

    def allocate(self, nbytes, stream=0):
        """Returns the device address of ``nbytes`` bytes usable on ``stream``.

        ``allocate(0)`` returns 0 and counts nothing (PyTorch's and CuPy's convention).
        Raises :class:`vmalloc.OutOfMemoryError` (with ``.stats``) when the memory cannot be
        had, :class:`vmalloc.InvalidArgumentError` for a negative or absurd size.
        """
        cdef size_t n
        cdef uintptr_t s
        cdef uintptr_t p
        cdef CAllocator* a = self.get()
        if type(nbytes) is int and nbytes >= 0 and nbytes <= _MAX_REQUEST:
            n = nbytes
        else:
            n = parse_size(nbytes, "nbytes")
        s = stream_handle(stream)
        try:
            with nogil:
                p = a.allocate(n, s)
        except OutOfMemoryError as error:
            error.stats = self.stats()
            raise
        return p

    def deallocate(self, ptr, nbytes=None, stream=0):
        """Gives back the allocation at ``ptr``. ``nbytes``, when given, must be the size asked
        for. It is reusable at once on ``stream``; other streams wait for the work queued on
        ``stream`` before this call. Raises :class:`vmalloc.InvalidPointerError` for a pointer
        that is not live here (nothing changes)."""
        cdef uintptr_t p
        cdef size_t n
        cdef uintptr_t s
        cdef CAllocator* a = self.get()
        if type(ptr) is not int or ptr < 0:
            raise TypeError(f"ptr must be a non-negative int device address, got {ptr!r}")
        p = ptr
        n = unknown_size if nbytes is None else parse_size(nbytes, "nbytes")
        s = stream_handle(stream)
        # The GIL is released: a deallocation does not wait for the device, but it waits for
        # the allocator's mutex, which an allocate may hold while it synchronizes.
        with nogil:
            a.deallocate(p, n, s)

    def release_cached(self):
        """Returns cached physical memory to the device; the number of bytes given back."""
        cdef CAllocator* a = self.get()
        cdef size_t n
        with nogil:
            n = a.release_cached()
        return n

    def stats(self):
        """A :class:`vmalloc.Stats` snapshot."""
        cdef CAllocator* a = self.get()
        cdef CStats s
        with nogil:
            s = a.stats()
        return stats_from_c(s)

    def reset_peak_stats(self):
        """Sets every ``peak_*`` statistic to its current value."""
        cdef CAllocator* a = self.get()
        with nogil:
            a.reset_peak_stats()

    def allocation_size(self, uintptr_t ptr):
        """The size asked for when the live allocation at ``ptr`` was made."""
        cdef CAllocator* a = self.get()
        cdef size_t n
        with nogil:
            n = a.allocation_size(ptr)
        return n

    def __repr__(self):
        if not self.c_allocator:
            return f"<{type(self).__name__} (uninitialized)>"
        cdef CAllocator* a = self.get()
        cdef CStats s
        with nogil:
            s = a.stats()
        return f"<{type(self).__name__} on {self.device.name}: {s.summary().decode()}>"
