# include/vmalloc/alloc/current_allocator.hpp: the per-device current allocator (what the C ABI,
# PyTorch and CuPy allocate from).
from libcpp.memory cimport shared_ptr
from libcpp.vector cimport vector

from vmalloc._lib.alloc.allocator cimport CAllocator
from vmalloc._lib.translate cimport vmalloc_raise_py_error


cdef extern from "vmalloc/alloc/current_allocator.hpp" namespace "vmalloc" nogil:
    int max_registry_devices
    # Prefixed with c_: the wrapper module's Python functions have the plain names.
    shared_ptr[CAllocator] c_set_current_allocator "vmalloc::set_current_allocator"(
        int device, shared_ptr[CAllocator] allocator) except +vmalloc_raise_py_error
    shared_ptr[CAllocator] c_current_allocator "vmalloc::current_allocator"(int device)
    vector[int] c_devices_with_current_allocator "vmalloc::devices_with_current_allocator"() \
        except +vmalloc_raise_py_error
