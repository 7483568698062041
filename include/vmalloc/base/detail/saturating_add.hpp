// a + b, or SIZE_MAX where that overflows: sums of chunk counts compared against a need.
#pragma once

#include <cstddef>
#include <limits>

namespace vmalloc::detail {

constexpr std::size_t saturating_add(std::size_t a, std::size_t b) noexcept {
  return a > std::numeric_limits<std::size_t>::max() - b ? std::numeric_limits<std::size_t>::max()
                                                         : a + b;
}

}  // namespace vmalloc::detail
