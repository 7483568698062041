# cython: language_level=3
"""PhysicalChunkPool: fixed-size physical chunks of a device and a cache of the unmapped ones
(the chunks layer under the virtual allocator)."""

from libc.stdint cimport uint64_t
from libcpp.memory cimport shared_ptr

from vmalloc._core.device cimport Device
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.chunks.physical_chunk_pool cimport ChunkPoolStats, CPhysicalChunkPool
from vmalloc._lib.device.device cimport CDevice

from vmalloc.sizes import parse_optional_size, parse_size


cdef class PhysicalChunkPool:
    """Fixed-size physical chunks of a device and a cache of the unmapped ones.

    The building block of :class:`vmalloc.VirtualAllocator`, exposed for tests and for users
    who map chunks themselves. Chunks are ``cuMemCreate`` handles (ints) of exactly
    ``chunk_size`` bytes; the pool releases every chunk it still holds when it goes.

    Args:
        device: the :class:`vmalloc.Device`.
        chunk_size: a positive multiple of the device granularity.
        budget: the most bytes of chunks held at once (at least one chunk), or ``None``.
    """

    def __cinit__(self, Device device not None, chunk_size="2MiB", budget=None):
        device.get()  # raises for a device that holds none
        cdef size_t c_chunk_size = parse_size(chunk_size, "chunk_size")
        cdef size_t c_budget = parse_optional_size(budget, "budget", "no budget")
        cdef shared_ptr[CDevice] c_device = device.c_device
        cdef CPhysicalChunkPool* pool
        with nogil:
            pool = new CPhysicalChunkPool(c_device, c_chunk_size, c_budget)
        self.c_pool.reset(pool)
        self.device = device

    def __init__(self, Device device not None, chunk_size="2MiB", budget=None):
        refuse_second_init(self, &self.init_called)

    def __dealloc__(self):
        # The pool releases its chunks, which may wait for the device: without the GIL.
        with nogil:
            self.c_pool.reset()

    cdef CPhysicalChunkPool* get(self) except NULL:
        # Unreachable from Python (__cinit__ builds the pool or raises): a guard for C code.
        if not self.c_pool:
            raise RuntimeError("PhysicalChunkPool is not initialized")
        return self.c_pool.get()

    def acquire(self):
        """A chunk handle: a cached chunk if any, else a new one. Raises
        :class:`vmalloc.OutOfMemoryError` when the budget or the device is full."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef uint64_t chunk
        with nogil:
            chunk = pool.acquire()
        return chunk

    def take_cached(self):
        """A cached chunk handle, or 0 when the cache is empty (never creates)."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef uint64_t chunk
        with nogil:
            chunk = pool.take_cached()
        return chunk

    def create(self):
        """A new chunk handle (never from the cache)."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef uint64_t chunk
        with nogil:
            chunk = pool.create()
        return chunk

    def give_back(self, chunk):
        """Returns an unmapped chunk to the cache."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef uint64_t c = chunk
        with nogil:
            pool.give_back(c)

    def release(self, chunk):
        """Releases a chunk held by the caller to the device."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef uint64_t c = chunk
        with nogil:
            pool.release(c)

    def release_cached(self):
        """Releases every cached chunk to the device; returns the bytes released."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef size_t n
        with nogil:
            n = pool.release_cached()
        return n

    def creatable_chunks(self):
        """How many more chunks the budget and the device's capacity allow (an estimate)."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef size_t n
        with nogil:
            n = pool.creatable_chunks()
        return n

    def stats(self):
        """A dict: ``chunk_size``, ``budget_bytes``, ``chunks_held``, ``peak_chunks_held``,
        ``chunks_cached``, ``chunks_created``, ``chunks_released``."""
        cdef CPhysicalChunkPool* pool = self.get()
        cdef ChunkPoolStats s
        with nogil:
            s = pool.stats()
        return {
            "chunk_size": s.chunk_size,
            "budget_bytes": s.budget_bytes,
            "chunks_held": s.chunks_held,
            "peak_chunks_held": s.peak_chunks_held,
            "chunks_cached": s.chunks_cached,
            "chunks_created": s.chunks_created,
            "chunks_released": s.chunks_released,
        }
