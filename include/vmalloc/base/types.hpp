// Plain integer handles shared by every part of vmalloc.
//
// They are integers, not pointers, so that the CUDA driver's handles (CUdeviceptr, CUstream,
// CUevent, CUmemGenericAllocationHandle) and the emulated device's handles travel through the
// same interface and through Python unchanged (CuPy's Stream.ptr, PyTorch's cuda_stream).
#pragma once

#include <cstddef>
#include <cstdint>

namespace vmalloc {

using device_ptr = std::uintptr_t;       // a device virtual address (CUdeviceptr); 0 is null
using stream_t = std::uintptr_t;         // a stream handle (CUstream); 0 is the default stream
using event_t = std::uintptr_t;          // an event handle (CUevent)
using physical_handle = std::uint64_t;   // a physical allocation (CUmemGenericAllocationHandle)

// Passed as `nbytes` to Allocator::deallocate when the caller does not know the size.
inline constexpr std::size_t unknown_size = static_cast<std::size_t>(-1);

// Requests above this are rejected as invalid rather than attempted: rounding them up to
// chunks or segments would overflow size_t arithmetic. 2^56 bytes = 64 PiB.
inline constexpr std::size_t max_request_bytes = std::size_t{1} << 56;

}  // namespace vmalloc
