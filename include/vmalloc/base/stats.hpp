// Allocator statistics, the same fields for every allocator so that they compare directly.
#pragma once

#include <cstddef>
#include <string>

namespace vmalloc {

struct Stats {
  // Sum of the sizes callers asked for, over live allocations (the paper's m_r summed).
  std::size_t requested_bytes = 0;
  std::size_t peak_requested_bytes = 0;
  // Physical device memory the allocator holds: backing live allocations plus cached.
  std::size_t reserved_bytes = 0;
  std::size_t peak_reserved_bytes = 0;
  // Bytes set aside for live allocations (the paper's m_a summed): chunk-rounded for mapped
  // allocations, block-rounded for sub-allocated or split ones.
  std::size_t allocated_bytes = 0;
  std::size_t peak_allocated_bytes = 0;
  // allocated_bytes - requested_bytes: internal fragmentation of live allocations.
  std::size_t internal_fragmentation_bytes = 0;
  std::size_t peak_internal_fragmentation_bytes = 0;
  // reserved_bytes - allocated_bytes: held but not backing any live allocation.
  std::size_t cached_bytes = 0;
  std::size_t live_allocations = 0;
  std::size_t peak_live_allocations = 0;
  std::size_t total_allocations = 0;   // successful allocate calls since construction
  std::size_t total_deallocations = 0;
  std::size_t out_of_memory_count = 0; // allocate calls that raised out-of-memory

  // "requested=1.9GiB reserved=2.0GiB (peak 4.0GiB) live=123 ..." for error messages.
  std::string summary() const;
};

}  // namespace vmalloc
