# cython: language_level=3
"""C++ timing loops for vmalloc.bench (the loop runs in C++, without the GIL)."""

from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector

from vmalloc._core.allocator cimport Allocator
from vmalloc._core.device cimport stream_handle
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.bench.bench cimport PairTiming, c_time_alloc_free_pairs, c_time_size_cycle

from vmalloc.sizes import parse_size


cdef dict _result(PairTiming t):
    return {"pairs": t.pairs, "seconds": t.seconds, "ns_per_pair": t.ns_per_pair}


def time_alloc_free_pairs(Allocator allocator not None, nbytes, size_t pairs=1_000_000,
                          stream=0, size_t warmup=16):
    """Times ``pairs`` allocate+deallocate pairs of ``nbytes`` in a C++ loop, after
    ``warmup`` untimed pairs. Returns ``{"pairs", "seconds", "ns_per_pair"}``."""
    cdef size_t n = parse_size(nbytes, "nbytes")
    cdef uintptr_t s = stream_handle(stream)
    cdef CAllocator* a = allocator.get()
    cdef PairTiming t
    with nogil:
        t = c_time_alloc_free_pairs(a[0], n, pairs, s, warmup)
    return _result(t)


def time_size_cycle(Allocator allocator not None, sizes, size_t depth=8,
                    size_t pairs=1_000_000, stream=0):
    """Times ``pairs`` allocations cycling through ``sizes`` with ``depth`` kept live (each
    allocation beyond that frees the oldest), in a C++ loop after one untimed round. Returns
    ``{"pairs", "seconds", "ns_per_pair"}``."""
    cdef vector[size_t] c_sizes
    for n in sizes:
        c_sizes.push_back(parse_size(n, "size"))
    cdef uintptr_t s = stream_handle(stream)
    cdef CAllocator* a = allocator.get()
    cdef PairTiming t
    with nogil:
        t = c_time_size_cycle(a[0], c_sizes, depth, pairs, s)
    return _result(t)
