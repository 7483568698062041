# include/vmalloc/c_api.h: the C ABI of libvmalloc.so (PyTorch's and CuPy's entry points and
# the per-thread last error). Python only takes the functions' addresses and reads the errors.

cdef extern from "vmalloc/c_api.h" nogil:
    int vmalloc_abi_version()
    const char* vmalloc_last_error()
    int vmalloc_last_error_code()
    void vmalloc_clear_last_error()
    void* vmalloc_torch_alloc(ssize_t size, int device, void* stream)
    void vmalloc_torch_free(void* ptr, ssize_t size, int device, void* stream)
    void vmalloc_torch_record_stream(void* ptr, void* stream)
    void vmalloc_torch_empty_cache()
    void* vmalloc_cupy_malloc(void* param, size_t size, int device_id)
    void vmalloc_cupy_free(void* param, void* ptr, int device_id)
