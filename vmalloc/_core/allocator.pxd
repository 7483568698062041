# The Python base class of every allocator wrapper (VirtualAllocator, CachingAllocator,
# LoggingAllocator). The C++ interface it wraps is declared in vmalloc/_lib/alloc/allocator.pxd.
from libcpp.memory cimport shared_ptr

from vmalloc._core.device cimport Device
from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.base.stats cimport CStats


cdef object stats_from_c(const CStats& s)


cdef class Allocator:
    cdef shared_ptr[CAllocator] c_allocator
    cdef readonly Device device
    cdef bint init_called  # see vmalloc/_core/init_once.pxd
    cdef CAllocator* get(self) except NULL


# A plain Allocator over a C++ allocator that has no Python wrapper (one set through the C
# ABI), on `device`.
cdef Allocator wrap_allocator(shared_ptr[CAllocator] c_allocator, Device device)
