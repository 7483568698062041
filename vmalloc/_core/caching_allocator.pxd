# CachingAllocator, the wrapper of vmalloc::CachingAllocator
# (vmalloc/_lib/alloc/caching_allocator.pxd).
from vmalloc._core.allocator cimport Allocator
from vmalloc._lib.alloc.caching_allocator cimport CCachingAllocator


cdef class CachingAllocator(Allocator):
    cdef CCachingAllocator* caching(self) except NULL
