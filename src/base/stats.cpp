#include "vmalloc/base/stats.hpp"

#include "vmalloc/base/detail/format.hpp"

namespace vmalloc {

using detail::human_bytes;

std::string Stats::summary() const {
  return "requested=" + human_bytes(requested_bytes) + " (peak " +
         human_bytes(peak_requested_bytes) + "), reserved=" + human_bytes(reserved_bytes) +
         " (peak " + human_bytes(peak_reserved_bytes) + "), cached=" + human_bytes(cached_bytes) +
         ", internal_fragmentation=" + human_bytes(internal_fragmentation_bytes) +
         ", live_allocations=" + std::to_string(live_allocations);
}

}  // namespace vmalloc
