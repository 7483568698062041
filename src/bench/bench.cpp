#include "vmalloc/bench/bench.hpp"

#include <chrono>
#include <deque>
#include <utility>

#include "vmalloc/base/errors.hpp"

namespace vmalloc::bench {

namespace {
using clock = std::chrono::steady_clock;

PairTiming finish(std::size_t pairs, clock::time_point start) {
  PairTiming t;
  t.pairs = pairs;
  t.seconds = std::chrono::duration<double>(clock::now() - start).count();
  t.ns_per_pair = pairs > 0 ? t.seconds * 1e9 / static_cast<double>(pairs) : 0.0;
  return t;
}
}  // namespace

PairTiming time_alloc_free_pairs(Allocator& allocator, std::size_t nbytes, std::size_t pairs,
                                 stream_t stream, std::size_t warmup) {
  if (nbytes == 0) throw InvalidArgument("bench: nbytes must be positive");
  for (std::size_t i = 0; i < warmup; ++i)
    allocator.deallocate(allocator.allocate(nbytes, stream), nbytes, stream);
  const auto start = clock::now();
  for (std::size_t i = 0; i < pairs; ++i)
    allocator.deallocate(allocator.allocate(nbytes, stream), nbytes, stream);
  return finish(pairs, start);
}

PairTiming time_size_cycle(Allocator& allocator, const std::vector<std::size_t>& sizes,
                           std::size_t depth, std::size_t pairs, stream_t stream) {
  if (sizes.empty()) throw InvalidArgument("bench: sizes must not be empty");
  for (std::size_t n : sizes)
    if (n == 0) throw InvalidArgument("bench: sizes must be positive");
  std::deque<std::pair<device_ptr, std::size_t>> live;
  auto run = [&](std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t n = sizes[i % sizes.size()];
      live.emplace_back(allocator.allocate(n, stream), n);
      if (live.size() > depth) {
        allocator.deallocate(live.front().first, live.front().second, stream);
        live.pop_front();
      }
    }
  };
  try {
    run(sizes.size() + depth);  // warm-up: every size cached at every depth position
    const auto start = clock::now();
    run(pairs);
    PairTiming t = finish(pairs, start);
    for (auto& [p, n] : live) allocator.deallocate(p, n, stream);
    return t;
  } catch (...) {
    for (auto& [p, n] : live) {
      try {
        allocator.deallocate(p, n, stream);
      } catch (...) {
      }
    }
    throw;
  }
}

}  // namespace vmalloc::bench
