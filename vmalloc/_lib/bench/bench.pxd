# include/vmalloc/bench/bench.hpp: C++ timing loops of vmalloc.bench (compiled into the _bench
# module only, not into libvmalloc.so).
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/bench/bench.hpp" namespace "vmalloc::bench" nogil:
    cdef cppclass PairTiming:
        size_t pairs
        double seconds
        double ns_per_pair

    PairTiming c_time_alloc_free_pairs "vmalloc::bench::time_alloc_free_pairs"(
        CAllocator& allocator, size_t nbytes, size_t pairs, uintptr_t stream, size_t warmup) \
        except +vmalloc_raise_py_error
    PairTiming c_time_size_cycle "vmalloc::bench::time_size_cycle"(
        CAllocator& allocator, const vector[size_t]& sizes, size_t depth, size_t pairs,
        uintptr_t stream) except +vmalloc_raise_py_error
