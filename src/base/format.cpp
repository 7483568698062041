#include "vmalloc/base/detail/format.hpp"

#include <cstdio>

namespace vmalloc::detail {

std::string hex(std::uint64_t value) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(value));
  return buf;
}

std::string human_bytes(std::size_t bytes, bool exact) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else if (exact)
    std::snprintf(buf, sizeof buf, "%.2f %s (%zu bytes)", v, units[u], bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace vmalloc::detail
