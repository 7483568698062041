# include/vmalloc/device/detail/cuda_driver.hpp: the driver library CudaDevice loads and the
# entry points it resolves (CudaDevice's static methods report them).
from libcpp.string cimport string
from libcpp.vector cimport vector


cdef extern from "vmalloc/device/detail/cuda_driver.hpp" namespace "vmalloc::driver" nogil:
    vector[string] driver_entry_point_symbols() except +
    string default_driver_library() except +
