// The allocators' map of live allocations by address (FlatMap, base/detail/flat_map.hpp): each
// deallocate() looks its pointer up; the map allocates only when it grows, never on the
// cache-hit path. Keys are non-zero.
#pragma once

#include <cstdint>

#include "vmalloc/base/detail/flat_map.hpp"

namespace vmalloc::detail {

// The allocators' map of live allocations: address -> a pointer-sized value (0: absent).
class FlatPtrMap : public FlatMap<std::uintptr_t> {
 public:
  FlatPtrMap() : FlatMap<std::uintptr_t>(32) {}
  // The value stored for a non-zero `key`, or 0.
  std::uintptr_t find(std::uintptr_t key) const noexcept {
    const std::uintptr_t* v = FlatMap::find(key);
    return v == nullptr ? 0 : *v;
  }
  // Inserts a key that is not present. May allocate unless reserve_one() came first.
  void insert(std::uintptr_t key, std::uintptr_t value) { try_emplace(key, value); }
  // Removes `key`; returns its value, or 0 if absent.
  std::uintptr_t erase(std::uintptr_t key) noexcept {
    const std::size_t i = find_slot(key);
    if (i == npos) return 0;
    const std::uintptr_t value = value_at(i);
    erase_at(i);
    return value;
  }
};

}  // namespace vmalloc::detail
