#include "vmalloc/stats.hpp"

#include <cstdio>

namespace vmalloc {

namespace {
std::string human(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zuB", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f%s", v, units[u]);
  return buf;
}
}  // namespace

std::string Stats::summary() const {
  return "requested=" + human(requested_bytes) + " (peak " + human(peak_requested_bytes) +
         "), reserved=" + human(reserved_bytes) + " (peak " + human(peak_reserved_bytes) +
         "), cached=" + human(cached_bytes) +
         ", internal_fragmentation=" + human(internal_fragmentation_bytes) +
         ", live_allocations=" + std::to_string(live_allocations);
}

}  // namespace vmalloc
