# PhysicalChunkPool, the wrapper of vmalloc::PhysicalChunkPool
# (vmalloc/_lib/chunks/physical_chunk_pool.pxd).
from libcpp.memory cimport unique_ptr

from vmalloc._core.device cimport Device
from vmalloc._lib.chunks.physical_chunk_pool cimport CPhysicalChunkPool


cdef class PhysicalChunkPool:
    cdef unique_ptr[CPhysicalChunkPool] c_pool
    cdef readonly Device device  # kept alive: the pool's chunks belong to it
    cdef bint init_called  # see vmalloc/_core/init_once.pxd
    cdef CPhysicalChunkPool* get(self) except NULL
