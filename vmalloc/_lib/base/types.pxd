# include/vmalloc/base/types.hpp

cdef extern from "vmalloc/base/types.hpp" namespace "vmalloc" nogil:
    # The size passed to deallocate when the caller does not know it.
    cdef size_t unknown_size
