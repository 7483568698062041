#include "vmalloc/detail/size_buckets.hpp"

namespace vmalloc::detail {

namespace {
inline std::size_t words_for(std::size_t bits) { return (bits + 63) / 64; }
}  // namespace

void HierarchicalBitmap::grow(std::size_t n) {
  if (n <= size_) return;
  size_ = n;
  // Level k has one bit per word of level k-1; stop once a level fits in a few words, which
  // the top-level scan then reads linearly.
  std::size_t bits = n;
  std::size_t level = 0;
  do {
    const std::size_t words = words_for(bits);
    if (level == levels_.size()) levels_.emplace_back();
    levels_[level].resize(words, 0);
    bits = words;
    ++level;
  } while (bits > 8);
  // Rebuild the summary levels from level 0 (new levels may have appeared).
  for (std::size_t k = 1; k < levels_.size(); ++k) {
    auto& above = levels_[k];
    const auto& below = levels_[k - 1];
    above.assign(words_for(below.size()), 0);
    for (std::size_t w = 0; w < below.size(); ++w)
      if (below[w] != 0) above[w >> 6] |= std::uint64_t{1} << (w & 63);
  }
}

std::size_t HierarchicalBitmap::find(std::size_t level, std::size_t i) const noexcept {
  const auto& bits = levels_[level];
  const std::size_t w = i >> 6;
  if (w >= bits.size()) return npos;
  const std::uint64_t here = bits[w] & (~std::uint64_t{0} << (i & 63));
  if (here != 0) return (w << 6) + static_cast<std::size_t>(__builtin_ctzll(here));
  std::size_t next = npos;
  if (level + 1 < levels_.size()) {
    next = find(level + 1, w + 1);
  } else {
    for (std::size_t x = w + 1; x < bits.size(); ++x)
      if (bits[x] != 0) {
        next = x;
        break;
      }
  }
  if (next == npos || next >= bits.size()) return npos;
  return (next << 6) + static_cast<std::size_t>(__builtin_ctzll(bits[next]));
}

}  // namespace vmalloc::detail
