# SwapManager, the wrapper of vmalloc::SwapManager (vmalloc/_lib/offload/swap_manager.pxd).
from libcpp.memory cimport shared_ptr

from vmalloc._core.allocator cimport Allocator
from vmalloc._lib.offload.swap_manager cimport CSwapManager


cdef class SwapManager:
    cdef shared_ptr[CSwapManager] c_manager
    cdef readonly Allocator allocator
    cdef bint init_called  # see vmalloc/_core/init_once.pxd
    cdef CSwapManager* get(self) except NULL
