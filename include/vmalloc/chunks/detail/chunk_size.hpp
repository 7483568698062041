// The chunk size of a chunk-mapping allocator from its options: 0 picks 2 MiB rounded up to the
// device granularity; otherwise it must be a positive multiple of the granularity (and of
// `also_multiple_of`, the allocator's own placement unit) within the request limit.
#pragma once

#include <cstddef>
#include <string>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/errors.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

inline constexpr std::size_t default_chunk_size = std::size_t{2} << 20;

// Throws InvalidArgument naming `owner`, the size and the device.
inline std::size_t resolve_chunk_size(const Device& device, std::size_t chunk_size,
                                      const char* owner, std::size_t also_multiple_of = 1) {
  const std::size_t g = device.granularity();
  if (chunk_size == 0) {
    if (g == 0) throw InvalidArgument(std::string(owner) + ": device " + device.name() +
                                      " reports a granularity of 0");
    return (default_chunk_size + g - 1) / g * g;
  }
  if (g == 0 || chunk_size % g != 0 || chunk_size > max_request_bytes ||
      chunk_size % also_multiple_of != 0)
    throw InvalidArgument(std::string(owner) + ": chunk_size " + std::to_string(chunk_size) +
                          " bytes is not a positive multiple of the granularity of device " +
                          device.name() + " (" + std::to_string(g) + " bytes)");
  return chunk_size;
}

}  // namespace vmalloc::detail
