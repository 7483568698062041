# include/vmalloc/base/stats.hpp: the statistics every allocator keeps (vmalloc.Stats).
from libcpp.string cimport string


cdef extern from "vmalloc/base/stats.hpp" namespace "vmalloc" nogil:
    cdef cppclass CStats "vmalloc::Stats":
        size_t requested_bytes
        size_t peak_requested_bytes
        size_t reserved_bytes
        size_t peak_reserved_bytes
        size_t allocated_bytes
        size_t peak_allocated_bytes
        size_t internal_fragmentation_bytes
        size_t peak_internal_fragmentation_bytes
        size_t cached_bytes
        size_t live_allocations
        size_t peak_live_allocations
        size_t total_allocations
        size_t total_deallocations
        size_t out_of_memory_count
        string summary()
