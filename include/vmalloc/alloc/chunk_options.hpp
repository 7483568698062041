// The options both virtual allocators (chunk and packed placement) take alike; each one's own
// options (VirtualAllocatorOptions, PackedVirtualAllocatorOptions) add to them.
#pragma once

#include <cstddef>

namespace vmalloc {

struct ChunkOptions {
  // Bytes per physical chunk; a positive multiple of the device granularity (and of 512 bytes,
  // the packed placement's unit). 0 picks 2 MiB rounded up to a multiple of the granularity.
  std::size_t chunk_size = 0;
  // The most bytes of chunks held at once; 0 = no budget (the device's capacity limits).
  std::size_t budget = 0;
};

}  // namespace vmalloc
