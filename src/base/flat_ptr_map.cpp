#include "vmalloc/base/detail/flat_ptr_map.hpp"

#include <utility>

namespace vmalloc::detail {

void FlatPtrMap::rehash(std::size_t capacity) {
  std::vector<Entry> old = std::move(entries_);
  entries_.assign(capacity, Entry{});
  mask_ = capacity - 1;
  unsigned bits = 0;
  while ((std::size_t{1} << bits) < capacity) ++bits;
  shift_ = 64 - bits;
  for (const Entry& e : old)
    if (e.key != 0) place(e.key, e.value);
}

std::uintptr_t FlatPtrMap::erase(std::uintptr_t key) noexcept {
  const std::size_t i = find_slot(key);
  if (i == npos) return 0;
  const std::uintptr_t value = entries_[i].value;
  erase_at(i);
  return value;
}

void FlatPtrMap::erase_at(std::size_t i) noexcept {
  // Backward-shift deletion: move later members of the probe run into the hole so that
  // lookups never need tombstones.
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & mask_; entries_[j].key != 0; j = (j + 1) & mask_) {
    const std::size_t home = slot_of(entries_[j].key);
    // entries_[j] may move into the hole iff its home is not in (hole, j] cyclically.
    const bool home_after_hole = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!home_after_hole) {
      entries_[hole] = entries_[j];
      hole = j;
    }
  }
  entries_[hole] = Entry{};
  --size_;
}

}  // namespace vmalloc::detail
