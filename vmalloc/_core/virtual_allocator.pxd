# VirtualAllocator, the wrapper of vmalloc::VirtualAllocator and vmalloc::PackedVirtualAllocator
# (vmalloc/_lib/alloc/virtual_allocator.pxd, packed_virtual_allocator.pxd): one Python class,
# the placement choosing the C++ class.
from libcpp.memory cimport shared_ptr

from vmalloc._core.allocator cimport Allocator
from vmalloc._core.device cimport Device
from vmalloc._lib.alloc.packed_virtual_allocator cimport CPackedVirtualAllocator
from vmalloc._lib.alloc.virtual_allocator cimport CVirtualAllocator


cdef class VirtualAllocator(Allocator):
    # Exactly one is set, as placement says; c_allocator shares its ownership.
    cdef shared_ptr[CVirtualAllocator] c_virtual
    cdef shared_ptr[CPackedVirtualAllocator] c_packed
    cdef readonly str placement

    cdef int build_chunks(self, Device device, chunk_size, budget, small_threshold,
                          steal_before_create) except -1
    cdef int build_packed(self, Device device, chunk_size, budget, small_threshold,
                          reservation_size, steal_before_create, remap_slack) except -1
    cdef CVirtualAllocator* chunks_only(self, what) except NULL
