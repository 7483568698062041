# Declarations of the C++ device interface (include/vmalloc/device/device.hpp) and the Python base
# class that every device wrapper (HostDevice, CudaDevice) derives from.
from libc.stdint cimport uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string


cdef extern from "_translate.hpp":
    cdef void vmalloc_raise_py_error()


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


cdef class Device:
    cdef shared_ptr[CDevice] c_device
    cdef CDevice* get(self) except NULL


# A stream argument as a CUstream integer: ints pass through; CuPy streams give .ptr,
# PyTorch streams .cuda_stream.
cdef uintptr_t stream_handle(object stream) except? 0
