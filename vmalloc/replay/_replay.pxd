# Replay, the wrapper of vmalloc::Replay (vmalloc/_lib/trace/replay.pxd).
from libcpp.memory cimport unique_ptr

from vmalloc._core.allocator cimport Allocator
from vmalloc._lib.trace.replay cimport CReplay


cdef class Replay:
    cdef unique_ptr[CReplay] c_replay
    cdef readonly Allocator allocator
    cdef bint init_called  # see vmalloc/_core/init_once.pxd
    cdef CReplay* get(self) except NULL
