# include/vmalloc/base/driver_calls.hpp: the driver calls a device counts, and their cost model.
from libc.stdint cimport uint64_t


cdef extern from "vmalloc/base/driver_calls.hpp" namespace "vmalloc" nogil:
    cdef size_t driver_call_count
    const char* driver_call_name_at(size_t index)

    cdef cppclass CostModel:
        double to_device_bytes_per_second
        double to_host_bytes_per_second
        double device_bytes_per_second
        double seconds_at(size_t index)
        void set_seconds_at(size_t index, double seconds)

    cdef cppclass CounterSnapshot:
        uint64_t bytes_to_device
        uint64_t bytes_to_host
        uint64_t bytes_device
        double modeled_seconds
        double modeled_copy_seconds
        uint64_t call_count_at(size_t index)
        uint64_t memory_management_calls()
