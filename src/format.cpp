#include "vmalloc/detail/format.hpp"

#include <cstdio>

namespace vmalloc::detail {

std::string hex(std::uint64_t value) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(value));
  return buf;
}

}  // namespace vmalloc::detail
