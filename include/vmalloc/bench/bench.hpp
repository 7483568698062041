// Timing loops for the allocation benchmark (vmalloc.bench), run entirely in C++ so that the
// figures measure the allocator, not the Python interpreter.
#pragma once

#include <cstddef>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::bench {

struct PairTiming {
  std::size_t pairs = 0;   // allocate+deallocate pairs timed
  double seconds = 0;      // wall time of the timed loop
  double ns_per_pair = 0;
};

// allocate(nbytes)+deallocate pairs on `stream`, after `warmup` untimed pairs: with a caching
// allocator every timed pair is a cache hit. Throws what the allocator throws.
PairTiming time_alloc_free_pairs(Allocator& allocator, std::size_t nbytes, std::size_t pairs,
                                 stream_t stream, std::size_t warmup = 16);

// Pairs over a cycle of sizes with `depth` allocations kept live (freed FIFO), so that the
// cache sees several sizes at once, as in a training step. One untimed round first.
PairTiming time_size_cycle(Allocator& allocator, const std::vector<std::size_t>& sizes,
                           std::size_t depth, std::size_t pairs, stream_t stream);

}  // namespace vmalloc::bench
