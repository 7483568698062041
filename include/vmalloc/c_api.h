/* vmalloc's C ABI, exported by libvmalloc.so (vmalloc.library_path() in Python).
 *
 * It lets code that cannot call C++ or Python use vmalloc allocators: PyTorch's pluggable
 * allocator (CUDAPluggableAllocator), CuPy's CFunctionAllocator, ctypes, or a C program.
 * Every request is routed to the *current allocator* of a device ordinal, set from Python
 * with vmalloc.set_current_allocator(allocator, device) or here with
 * vmalloc_set_current_allocator().
 *
 * Errors: no C++ exception ever crosses this ABI. A failing call returns NULL (allocations)
 * or a nonzero vmalloc_status, and records a message and a status for the calling thread,
 * readable with vmalloc_last_error() and vmalloc_last_error_code(). They stay until the
 * next failure in that thread or vmalloc_clear_last_error() (like errno): check the return
 * value first. Functions returning void (the framework hooks) report failures only there.
 *
 * Ownership: an allocation made through this ABI remembers the allocator that made it, so
 * it is freed to that allocator even if the device's current allocator changed meanwhile,
 * and that allocator stays alive until its last such allocation is freed.
 *
 * Thread-safe: every function may be called from any thread.
 */
#ifndef VMALLOC_C_API_H
#define VMALLOC_C_API_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#if defined(__GNUC__)
#define VMALLOC_C_API __attribute__((visibility("default")))
#else
#define VMALLOC_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a signature or a struct layout changes; fields are only ever appended. */
#define VMALLOC_C_API_VERSION 1

/* Pass as the size to vmalloc_deallocate() when it is not known. */
#define VMALLOC_UNKNOWN_SIZE ((size_t)-1)

typedef enum vmalloc_status {
  VMALLOC_SUCCESS = 0,
  VMALLOC_ERROR_INVALID_ARGUMENT = 1, /* a size or ordinal that can never be valid */
  VMALLOC_ERROR_INVALID_POINTER = 2,  /* not a live allocation (double free, unknown) */
  VMALLOC_ERROR_OUT_OF_MEMORY = 3,    /* the device or the allocator's budget is full */
  VMALLOC_ERROR_DEVICE = 4,           /* a driver call failed (message names it and CUresult) */
  VMALLOC_ERROR_NO_ALLOCATOR = 5,     /* the device ordinal has no current allocator */
  VMALLOC_ERROR_INTERNAL = 6          /* anything else (host out of memory, ...) */
} vmalloc_status;

/* An opaque counted reference to a vmalloc allocator. */
typedef struct vmalloc_allocator vmalloc_allocator;

/* The fields of vmalloc.Stats (include/vmalloc/base/stats.hpp), in bytes and counts. */
typedef struct vmalloc_stats {
  uint64_t requested_bytes;
  uint64_t peak_requested_bytes;
  uint64_t reserved_bytes;
  uint64_t peak_reserved_bytes;
  uint64_t allocated_bytes;
  uint64_t peak_allocated_bytes;
  uint64_t internal_fragmentation_bytes;
  uint64_t peak_internal_fragmentation_bytes;
  uint64_t cached_bytes;
  uint64_t live_allocations;
  uint64_t peak_live_allocations;
  uint64_t total_allocations;
  uint64_t total_deallocations;
  uint64_t out_of_memory_count;
} vmalloc_stats;

/* VMALLOC_C_API_VERSION of the library actually loaded. */
VMALLOC_C_API int vmalloc_abi_version(void);

/* ---- errors (per thread) ---- */

/* The message of this thread's most recent failure, "" when none. Valid until the next
 * vmalloc call in this thread. */
VMALLOC_C_API const char* vmalloc_last_error(void);
/* The vmalloc_status of this thread's most recent failure, VMALLOC_SUCCESS when none. */
VMALLOC_C_API int vmalloc_last_error_code(void);
VMALLOC_C_API void vmalloc_clear_last_error(void);

/* ---- the per-device current allocator ---- */

/* A new reference to the current allocator of `device`; NULL (VMALLOC_ERROR_NO_ALLOCATOR)
 * when it has none. Give it back with vmalloc_allocator_release(). */
VMALLOC_C_API vmalloc_allocator* vmalloc_get_current_allocator(int device);
/* Makes `allocator` (NULL: none) the current allocator of `device`. The caller keeps its
 * reference. Returns a vmalloc_status. */
VMALLOC_C_API int vmalloc_set_current_allocator(int device, vmalloc_allocator* allocator);
/* Drops a reference from vmalloc_get_current_allocator(). NULL is a no-op. */
VMALLOC_C_API void vmalloc_allocator_release(vmalloc_allocator* allocator);

/* ---- allocation through the current allocator ---- */

/* Memory of at least `size` bytes on `device`, usable at once by work on `stream` (a CUstream;
 * NULL is the default stream). size 0 returns NULL and is not an error. */
VMALLOC_C_API void* vmalloc_allocate(int device, size_t size, void* stream);
/* Frees `ptr` (NULL: no-op). `size` is the size asked for, or VMALLOC_UNKNOWN_SIZE. Work
 * queued on `stream` before the call may still use the memory. Returns a vmalloc_status; on
 * failure nothing changed. */
VMALLOC_C_API int vmalloc_deallocate(int device, void* ptr, size_t size, void* stream);
/* Declares that work on `stream` uses `ptr` (an allocation made through this ABI), so its
 * free waits for the work queued on `stream` until then (like Tensor.record_stream). */
VMALLOC_C_API int vmalloc_record_stream(void* ptr, void* stream);

/* The current allocator's statistics for `device`. Returns a vmalloc_status. */
VMALLOC_C_API int vmalloc_get_stats(int device, vmalloc_stats* out);
/* Sets every peak statistic of `device`'s current allocator to its current value. */
VMALLOC_C_API int vmalloc_reset_peak_stats(int device);
/* Returns `device`'s cached memory to the device; `device` -1 means every device with a
 * current allocator. Writes the bytes given back to *released unless it is NULL. */
VMALLOC_C_API int vmalloc_release_cached(int device, size_t* released);

/* ---- PyTorch: torch.cuda.memory.CUDAPluggableAllocator(path, "vmalloc_torch_alloc",
 *      "vmalloc_torch_free"); the stream types are cudaStream_t ---- */

/* NULL on failure (PyTorch does not check: see docs/pytorch.rst). */
VMALLOC_C_API void* vmalloc_torch_alloc(ssize_t size, int device, void* stream);
/* `stream` is the stream the allocation was made on, as PyTorch passes it. */
VMALLOC_C_API void vmalloc_torch_free(void* ptr, ssize_t size, int device, void* stream);
/* set_record_stream_fn hook: Tensor.record_stream(stream). */
VMALLOC_C_API void vmalloc_torch_record_stream(void* ptr, void* stream);
/* set_reset_fn hook: torch.cuda.empty_cache() releases every device's cached memory. */
VMALLOC_C_API void vmalloc_torch_empty_cache(void);

/* ---- CuPy: cupy.cuda.memory.CFunctionAllocator's malloc/free signatures. `param` carries
 *      the CUstream the memory is for (NULL: the default stream); CuPy hands the same
 *      param back to free. ---- */

VMALLOC_C_API void* vmalloc_cupy_malloc(void* param, size_t size, int device_id);
VMALLOC_C_API void vmalloc_cupy_free(void* param, void* ptr, int device_id);

#ifdef __cplusplus
}
#endif

#endif /* VMALLOC_C_API_H */
