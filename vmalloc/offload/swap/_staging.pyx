# cython: language_level=3
"""Pinned host staging for data streamed to the device (:class:`vmalloc.offload.PageStream`):
blocks come from the :class:`~vmalloc.offload.SwapManager`'s own staging pool, so they are
reused across pages, count against its ``host_capacity`` and show in its ``stats()``
(``host_bytes_in_use``, ``host_blocks_in_use``). The copies themselves go through the device
(``copy_to_device`` on the manager's host-to-device stream); nothing here copies to a device.
"""

from libc.stdint cimport uintptr_t
from libc.string cimport memcpy

from vmalloc._lib.offload.host_staging_pool cimport CHostStagingPool
from vmalloc._lib.offload.swap_manager cimport CSwapManager
from vmalloc.offload.swap._swap_manager cimport SwapManager

from vmalloc.sizes import parse_size


def stage(SwapManager manager not None, nbytes):
    """A pinned host block of at least ``nbytes`` (> 0) bytes from ``manager``'s staging pool;
    its address. Raises :class:`vmalloc.OutOfMemoryError` beyond the manager's
    ``host_capacity`` (nothing changes then)."""
    cdef size_t n = parse_size(nbytes, "nbytes")
    if n == 0:
        raise ValueError("stage: nbytes must be positive")
    cdef CSwapManager* m = manager.get()
    cdef void* p
    with nogil:
        p = m.staging().allocate(n)
    return <uintptr_t>p


def unstage(SwapManager manager not None, uintptr_t block):
    """Returns a block :func:`stage` gave to ``manager``'s pool (for reuse); raises
    :class:`vmalloc.InvalidArgumentError` for an address the pool did not hand out."""
    cdef CSwapManager* m = manager.get()
    with nogil:
        m.staging().deallocate(<void*>block)


def block_size(nbytes):
    """The bytes a block serving a request of ``nbytes`` holds (its size class)."""
    return CHostStagingPool.size_class(parse_size(nbytes, "nbytes"))


def fill(uintptr_t block, source):
    """Copies the bytes of ``source`` (a C-contiguous buffer) to the host address ``block``
    with the GIL released (a page copied on a worker thread lets the others run)."""
    cdef const unsigned char[::1] view = memoryview(source).cast("B")
    cdef size_t n = view.shape[0]
    if n == 0:
        return 0
    with nogil:
        memcpy(<void*>block, &view[0], n)
    return n
