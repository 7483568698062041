# dladdr from <dlfcn.h> (a GNU extension Cython's posix/dlfcn.pxd does not declare): finds the
# file a loaded symbol came from, i.e. where libvmalloc.so is.

cdef extern from "<dlfcn.h>" nogil:
    ctypedef struct Dl_info:
        const char* dli_fname

    int dladdr(const void* addr, Dl_info* info)
