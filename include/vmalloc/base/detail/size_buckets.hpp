// Free lists bucketed by exact size, with constant-time best fit.
//
// A cache of free ranges (or blocks) must find "the smallest free thing of at least n units"
// on every allocation, without allocating memory on that path. SizeBuckets keeps one
// intrusive doubly linked list per size in units (chunks or 512-byte blocks) and a
// hierarchical bitmap of the non-empty lists, so best fit is a few find-first-set
// instructions and insert/remove touch no heap once the largest size has been seen.
//
// Not thread-safe: the owning allocator's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vmalloc::detail {

// Bit set over [0, size) with "first set bit at or after i" in O(levels). Level 0 holds the
// bits; each higher level has one bit per non-zero word of the level below. All levels live
// in one array (no per-level indirection on the hot path: set/clear/find are a few loads).
class HierarchicalBitmap {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::size_t size() const noexcept { return size_; }
  // Grows to hold at least `n` bits, keeping the bits set. Allocates; not on hot paths.
  void grow(std::size_t n);
  void set(std::size_t i) noexcept {
    std::uint64_t* const words = words_.data();
    for (unsigned level = 0; level < levels_; ++level) {
      std::uint64_t& word = words[start_[level] + (i >> 6)];
      const std::uint64_t old = word;
      word = old | std::uint64_t{1} << (i & 63);
      if (old != 0) return;  // the levels above already know this word is non-zero
      i >>= 6;
    }
  }
  void clear(std::size_t i) noexcept {
    std::uint64_t* const words = words_.data();
    for (unsigned level = 0; level < levels_; ++level) {
      std::uint64_t& word = words[start_[level] + (i >> 6)];
      word &= ~(std::uint64_t{1} << (i & 63));
      if (word != 0) return;
      i >>= 6;
    }
  }
  bool test(std::size_t i) const noexcept {
    return i < size_ && (words_[i >> 6] >> (i & 63) & 1u);
  }
  // The first set bit >= i, or npos.
  std::size_t find_next(std::size_t i) const noexcept {
    if (i >= size_) return npos;
    // Fast path: a set bit in i's own word (exact and near fits). Level 0 starts at word 0.
    const std::uint64_t here = words_[i >> 6] & (~std::uint64_t{0} << (i & 63));
    if (here != 0) return (i & ~std::size_t{63}) + static_cast<std::size_t>(__builtin_ctzll(here));
    return find_above(i >> 6);
  }

 private:
  // Enough levels for any size_t: 64^11 > 2^64.
  static constexpr unsigned max_levels = 11;
  // The first set bit in a level-0 word after word `w`, or npos.
  std::size_t find_above(std::size_t w) const noexcept;

  std::size_t size_ = 0;
  unsigned levels_ = 0;
  std::size_t start_[max_levels] = {};  // first word of each level in words_
  std::size_t count_[max_levels] = {};  // words of each level
  std::vector<std::uint64_t> words_;
};

// The hooks a Node needs: `Node* bucket_prev; Node* bucket_next; std::size_t bucket;`.
template <typename Node>
class SizeBuckets {
 public:
  static constexpr std::size_t npos = HierarchicalBitmap::npos;

  // Makes room for sizes up to `units`, so that insert() of them never allocates. Allocates.
  void reserve(std::size_t units) {
    if (units >= heads_.size()) grow_to(units);
  }

  // Adds `node` to the list of `units`, at the front (the most recently freed is reused first:
  // it is the likeliest to be warm and to share the caller's stream). Allocates only for a
  // size beyond reserve().
  void insert(Node* node, std::size_t units) {
    if (units >= heads_.size()) grow_to(units);
    Node*& head = heads_[units];
    node->bucket = units;
    node->bucket_prev = nullptr;
    node->bucket_next = head;
    if (head != nullptr) head->bucket_prev = node;
    else nonempty_.set(units);
    head = node;
    ++count_;
  }

  void remove(Node* node) noexcept {
    Node* const prev = node->bucket_prev;
    Node* const next = node->bucket_next;
    if (next != nullptr) next->bucket_prev = prev;
    if (prev != nullptr) {
      prev->bucket_next = next;
    } else {
      heads_[node->bucket] = next;
      if (next == nullptr) nonempty_.clear(node->bucket);
    }
    node->bucket_prev = node->bucket_next = nullptr;
    --count_;
  }

  // The smallest non-empty size >= units, or npos.
  std::size_t best_fit(std::size_t units) const noexcept { return nonempty_.find_next(units); }
  Node* head(std::size_t units) const noexcept {
    return units < heads_.size() ? heads_[units] : nullptr;
  }
  std::size_t count() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }

  // Calls f(node) for every node (f must not modify the buckets).
  template <typename F>
  void for_each(F&& f) const {
    for (std::size_t u = nonempty_.find_next(0); u != npos; u = nonempty_.find_next(u + 1))
      for (Node* n = heads_[u]; n != nullptr; n = n->bucket_next) f(n);
  }

 private:
  // Out of line and cold, so that insert() stays small enough to inline on hot paths.
  __attribute__((noinline, cold)) void grow_to(std::size_t units) {
    const std::size_t n = units + 1 > 2 * heads_.size() ? units + 1 : 2 * heads_.size();
    nonempty_.grow(n);
    heads_.resize(n, nullptr);
  }

  std::vector<Node*> heads_;
  HierarchicalBitmap nonempty_;
  std::size_t count_ = 0;
};

}  // namespace vmalloc::detail
