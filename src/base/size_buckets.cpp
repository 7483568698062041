#include "vmalloc/base/detail/size_buckets.hpp"

namespace vmalloc::detail {

namespace {
inline std::size_t words_for(std::size_t bits) { return (bits + 63) / 64; }
inline std::size_t ctz(std::uint64_t x) { return static_cast<std::size_t>(__builtin_ctzll(x)); }
}  // namespace

void HierarchicalBitmap::grow(std::size_t n) {
  if (n <= size_) return;
  // Level k has one bit per word of level k-1; stop once a level fits in a few words, which
  // the top-level scan then reads linearly.
  unsigned levels = 0;
  std::size_t start[max_levels] = {}, count[max_levels] = {};
  std::size_t total = 0, bits = n;
  do {
    start[levels] = total;
    count[levels] = words_for(bits);
    total += count[levels];
    bits = count[levels];
    ++levels;
  } while (bits > 8);
  std::vector<std::uint64_t> words(total, 0);  // may throw: nothing changed
  for (std::size_t w = 0; w < count_[0]; ++w) words[w] = words_[w];
  // Rebuild the summary levels from level 0.
  for (unsigned k = 1; k < levels; ++k)
    for (std::size_t w = 0; w < count[k - 1]; ++w)
      if (words[start[k - 1] + w] != 0) words[start[k] + (w >> 6)] |= std::uint64_t{1} << (w & 63);
  words_.swap(words);
  size_ = n;
  levels_ = levels;
  for (unsigned k = 0; k < max_levels; ++k) {
    start_[k] = start[k];
    count_[k] = count[k];
  }
}

std::size_t HierarchicalBitmap::find_above(std::size_t w) const noexcept {
  const std::uint64_t* const words = words_.data();
  // Climb: look for the first non-empty word of `level` at index >= i, in the level above
  // (bit i of level + 1 says whether word i of `level` is non-empty).
  unsigned level = 0;
  std::size_t i = w + 1;
  std::size_t word;  // a non-empty word of `level`, the first at or after the start
  for (;;) {
    if (level + 1 == levels_) {
      // The top level is a few words: scan them.
      std::size_t y = i;
      while (y < count_[level] && words[start_[level] + y] == 0) ++y;
      if (y >= count_[level]) return npos;
      word = y;
      break;
    }
    const std::size_t x = i >> 6;
    if (x >= count_[level + 1]) return npos;
    const std::uint64_t here = words[start_[level + 1] + x] & (~std::uint64_t{0} << (i & 63));
    if (here != 0) {
      word = (x << 6) + ctz(here);
      break;
    }
    i = x + 1;
    ++level;
  }
  // Descend: the lowest set bit of that word is the first set bit (or non-empty word) below.
  for (;;) {
    const std::size_t bit = (word << 6) + ctz(words[start_[level] + word]);
    if (level == 0) return bit;
    --level;
    word = bit;
  }
}

}  // namespace vmalloc::detail
