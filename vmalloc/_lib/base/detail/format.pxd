# include/vmalloc/base/detail/format.hpp: numbers as text for the library's messages, among
# them the C++ side's one byte formatter.
from libcpp cimport bool
from libcpp.string cimport string


cdef extern from "vmalloc/base/detail/format.hpp" namespace "vmalloc::detail" nogil:
    string human_bytes(size_t bytes, bool exact)
