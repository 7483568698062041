"""Which driver calls fault injection can fail, and how each fails on a GPU.

One list for every fault-injection suite (allocators, swap manager, users' own): a call added
to the device layer is added here once, and every suite then fails it at every call site.
"""

#: The driver calls a Device makes for allocators and the swap manager (contexts are failed
#: separately: they wrap every call).
FAULTABLE_CALLS = (
    "cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap",
    "cuMemUnmap", "cuMemSetAccess", "cuMemHostAlloc", "cuMemFreeHost", "cuStreamCreate",
    "cuStreamDestroy", "cuEventCreate", "cuEventDestroy", "cuEventRecord", "cuEventQuery",
    "cuEventSynchronize", "cuStreamWaitEvent", "cuStreamSynchronize", "cuCtxSynchronize",
    "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync",
)

# Allocation calls fail for lack of memory on a GPU; anything else fails for a reason the
# caller cannot act on.
_OUT_OF_MEMORY_CALLS = frozenset({"cuMemCreate", "cuMemHostAlloc", "cuMemAddressReserve"})


def failure_code(call):
    """The CUresult name a GPU returns when ``call`` fails (for ``DriverEmulator.fault``)."""
    return "CUDA_ERROR_OUT_OF_MEMORY" if call in _OUT_OF_MEMORY_CALLS else "CUDA_ERROR_UNKNOWN"
