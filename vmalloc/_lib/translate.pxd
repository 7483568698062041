# vmalloc/_core/translate.hpp: turns the C++ exception being handled into the matching
# exception of vmalloc.errors. Every C++ call that may throw is declared `except +vmalloc_raise_py_error`.

cdef extern from "_core/translate.hpp":
    cdef void vmalloc_raise_py_error()
