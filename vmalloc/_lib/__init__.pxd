# vmalloc._lib: Cython declarations of libvmalloc's C++ API, and nothing else (no code, no
# Python-visible names). The tree mirrors include/vmalloc/: _lib/<layer>/<header>.pxd declares
# include/vmalloc/<layer>/<header>.hpp, so a header's declarations are found (and changed) in
# one place, and a .pxd cimports only from its own layer and the layers below it, as the
# header includes (tests/architecture/test_cython_layout.py checks both). The wrapper modules
# (vmalloc/_core/*.pyx, and the few beside their single user) cimport from here; none declares
# C++ itself.
#
# Outside the mirror: translate.pxd (vmalloc/_core/translate.hpp, the C++ -> Python exception
# translation every `except +` names), c_api.pxd (include/vmalloc/c_api.h) and dlfcn.pxd
# (the part of <dlfcn.h> that Cython's posix/dlfcn.pxd lacks).
