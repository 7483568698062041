// The project's one open-addressing hash map, from 64-bit keys (device addresses) to values
// stored inline: linear probing, Fibonacci hashing, backward-shift deletion (no tombstones),
// load <= 1/2. std::unordered_map allocates a node per insert and misses the cache twice per
// lookup; this allocates only when it grows past its largest size so far. Key 0 has a slot of
// its own. Not thread-safe (the owner locks).
//
// Users: the allocators' live allocations (FlatPtrMap), the trace normalizer's live addresses,
// the profiler trace's scan for memory live before the window, the snapshot reader's
// address sets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace vmalloc::detail {

template <class V>
class FlatMap {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  // Room for `expected` keys before the first growth.
  explicit FlatMap(std::size_t expected = 32) {
    std::size_t capacity = 64;
    while (capacity < 2 * expected) capacity *= 2;
    rehash(capacity);
  }

  std::size_t size() const noexcept { return size_ + has_zero_; }
  bool empty() const noexcept { return size() == 0; }

  // The value of `key`, or nullptr.
  V* find(std::uint64_t key) noexcept {
    if (key == 0) return has_zero_ ? &zero_ : nullptr;
    const std::size_t i = find_slot(key);
    return i == npos ? nullptr : &entries_[i].value;
  }
  const V* find(std::uint64_t key) const noexcept {
    return const_cast<FlatMap*>(this)->find(key);
  }

  // The value of `key`, inserted as `value` if absent (then .second is true). May allocate
  // (growth) unless reserve_one() came first.
  std::pair<V*, bool> try_emplace(std::uint64_t key, const V& value = V()) {
    if (key == 0) {
      const bool inserted = !has_zero_;
      if (inserted) zero_ = value;
      has_zero_ = true;
      return {&zero_, inserted};
    }
    reserve_one();
    std::size_t i = slot_of(key);
    for (;; i = (i + 1) & mask_) {
      Entry& e = entries_[i];
      if (e.key == key) return {&e.value, false};
      if (e.key == 0) {
        e.key = key;
        e.value = value;
        ++size_;
        return {&e.value, true};
      }
    }
  }
  V& operator[](std::uint64_t key) { return *try_emplace(key).first; }

  // Makes room for one more key, so that the next insert cannot throw. May allocate.
  void reserve_one() {
    if (2 * (size_ + 1) > entries_.size()) rehash(2 * entries_.size());
  }

  // Removes `key`; false if absent.
  bool erase(std::uint64_t key) noexcept {
    if (key == 0) {
      const bool had = has_zero_;
      has_zero_ = false;
      return had;
    }
    const std::size_t i = find_slot(key);
    if (i == npos) return false;
    erase_at(i);
    return true;
  }

  // One probe for a lookup followed by a removal or an update: the slot of a non-zero `key`
  // (npos if absent), valid until the map next changes.
  std::size_t find_slot(std::uint64_t key) const noexcept {
    for (std::size_t i = slot_of(key);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.key == key) return i;
      if (e.key == 0) return npos;
    }
  }
  V& value_at(std::size_t slot) noexcept { return entries_[slot].value; }
  const V& value_at(std::size_t slot) const noexcept { return entries_[slot].value; }
  void erase_at(std::size_t i) noexcept {
    // Backward shift: later members of the probe run move into the hole when their home is
    // not in (hole, j] cyclically, so lookups never meet a tombstone.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask_; entries_[j].key != 0; j = (j + 1) & mask_) {
      const std::size_t home = slot_of(entries_[j].key);
      const bool home_after_hole =
          hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!home_after_hole) {
        entries_[hole] = std::move(entries_[j]);
        hole = j;
      }
    }
    entries_[hole] = Entry{};
    --size_;
  }

  // Fetches the slot `key` hashes to (for a lookup a few iterations ahead).
  void prefetch(std::uint64_t key) const noexcept {
    __builtin_prefetch(entries_.data() + slot_of(key));
  }

  template <typename F>
  void for_each(F&& f) const {
    if (has_zero_) f(std::uint64_t{0}, zero_);
    for (const Entry& e : entries_)
      if (e.key != 0) f(e.key, e.value);
  }

  // Bytes held.
  std::size_t memory() const noexcept { return entries_.capacity() * sizeof(Entry); }

 private:
  struct Entry {
    std::uint64_t key = 0;
    V value{};
  };

  std::size_t slot_of(std::uint64_t key) const noexcept {
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void rehash(std::size_t capacity) {
    std::vector<Entry> old(capacity);
    old.swap(entries_);
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    for (Entry& e : old) {
      if (e.key == 0) continue;
      std::size_t i = slot_of(e.key);
      while (entries_[i].key != 0) i = (i + 1) & mask_;
      entries_[i] = std::move(e);
    }
  }

  std::vector<Entry> entries_;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;  // non-zero keys
  V zero_{};
  bool has_zero_ = false;
};

}  // namespace vmalloc::detail
