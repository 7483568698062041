// An open-addressing hash map from device addresses to node pointers.
//
// The allocators look every deallocate() up by address. std::unordered_map allocates a node
// per insert, which would put the heap on the cache-hit path; this map stores keys and values
// inline (linear probing, backward-shift deletion, load <= 1/2), so it allocates only when it
// grows past its largest size so far. Keys are non-zero. Not thread-safe (the owner locks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vmalloc::detail {

class FlatPtrMap {
 public:
  FlatPtrMap() { rehash(64); }

  std::size_t size() const noexcept { return size_; }

  // The value stored for `key`, or 0.
  std::uintptr_t find(std::uintptr_t key) const noexcept {
    const std::size_t i = find_slot(key);
    return i == npos ? 0 : entries_[i].value;
  }

  // Makes room for one more key, so that the next insert() cannot throw. May allocate.
  void reserve_one() {
    if (2 * (size_ + 1) > entries_.size()) rehash(2 * entries_.size());
  }
  // Inserts a key that is not present. May allocate (growth) unless reserve_one() came first.
  void insert(std::uintptr_t key, std::uintptr_t value) {
    reserve_one();
    place(key, value);
    ++size_;
  }

  // Removes `key`; returns its value, or 0 if absent.
  std::uintptr_t erase(std::uintptr_t key) noexcept;

  // One probe for a lookup followed by a removal: the slot of `key` (npos if absent), valid
  // until the map next changes; its value; its removal.
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  std::size_t find_slot(std::uintptr_t key) const noexcept {
    for (std::size_t i = slot_of(key);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.key == key) return i;
      if (e.key == 0) return npos;
    }
  }
  std::uintptr_t value_at(std::size_t slot) const noexcept { return entries_[slot].value; }
  void erase_at(std::size_t slot) noexcept;

  template <typename F>
  void for_each(F&& f) const {
    for (const Entry& e : entries_)
      if (e.key != 0) f(e.key, e.value);
  }

 private:
  struct Entry {
    std::uintptr_t key = 0;
    std::uintptr_t value = 0;
  };

  std::size_t slot_of(std::uintptr_t key) const noexcept {
    // Addresses are multiples of 512 at least: drop those bits, then Fibonacci hashing.
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }
  void place(std::uintptr_t key, std::uintptr_t value) noexcept {
    std::size_t i = slot_of(key);
    while (entries_[i].key != 0) i = (i + 1) & mask_;
    entries_[i] = Entry{key, value};
  }
  void rehash(std::size_t capacity);

  std::vector<Entry> entries_;
  std::size_t mask_ = 0;
  unsigned shift_ = 0;
  std::size_t size_ = 0;
};

}  // namespace vmalloc::detail
