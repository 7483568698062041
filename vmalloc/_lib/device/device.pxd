# include/vmalloc/device/device.hpp: the device interface (the driver's virtual memory calls,
# streams, events and copies) that HostDevice and CudaDevice implement.
from libc.stdint cimport uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.string cimport string

from vmalloc._lib.base.driver_calls cimport CostModel, CounterSnapshot
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/device/device.hpp" namespace "vmalloc" nogil:
    cdef cppclass CDevice "vmalloc::Device":
        string name()
        int ordinal()
        size_t granularity()
        size_t recommended_granularity()
        size_t capacity()
        size_t physical_bytes_in_use()
        bool backed()
        uint64_t create(size_t size) except +vmalloc_raise_py_error
        void release(uint64_t handle) except +vmalloc_raise_py_error
        uintptr_t reserve(size_t size, size_t alignment) except +vmalloc_raise_py_error
        void free_address(uintptr_t ptr, size_t size) except +vmalloc_raise_py_error
        void map(uintptr_t ptr, size_t size, uint64_t handle) except +vmalloc_raise_py_error
        void unmap(uintptr_t ptr, size_t size) except +vmalloc_raise_py_error
        void set_access(uintptr_t ptr, size_t size) except +vmalloc_raise_py_error
        void* host_alloc(size_t size) except +vmalloc_raise_py_error
        void host_free(void* ptr) except +vmalloc_raise_py_error
        uintptr_t create_stream() except +vmalloc_raise_py_error
        void destroy_stream(uintptr_t stream) except +vmalloc_raise_py_error
        uintptr_t create_event() except +vmalloc_raise_py_error
        void destroy_event(uintptr_t event) except +vmalloc_raise_py_error
        void record_event(uintptr_t event, uintptr_t stream) except +vmalloc_raise_py_error
        bool query_event(uintptr_t event) except +vmalloc_raise_py_error
        void synchronize_event(uintptr_t event) except +vmalloc_raise_py_error
        void wait_event(uintptr_t stream, uintptr_t event) except +vmalloc_raise_py_error
        void synchronize_stream(uintptr_t stream) except +vmalloc_raise_py_error
        void synchronize() except +vmalloc_raise_py_error
        void copy_to_device(uintptr_t dst, const void* src, size_t nbytes,
                            uintptr_t stream) except +vmalloc_raise_py_error
        void copy_to_host(void* dst, uintptr_t src, size_t nbytes,
                          uintptr_t stream) except +vmalloc_raise_py_error
        void copy_device(uintptr_t dst, uintptr_t src, size_t nbytes,
                         uintptr_t stream) except +vmalloc_raise_py_error
        CounterSnapshot counters()
        void reset_counters()
        CostModel cost_model()
        void set_cost_model(const CostModel& model) except +vmalloc_raise_py_error
