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
// bits; each higher level has one bit per non-zero word of the level below.
class HierarchicalBitmap {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::size_t size() const noexcept { return size_; }
  // Grows to hold at least `n` bits, keeping the bits set. Allocates; not on hot paths.
  void grow(std::size_t n);
  void set(std::size_t i) noexcept {
    for (auto& bits : levels_) {
      std::uint64_t& word = bits[i >> 6];
      const bool was_zero = word == 0;
      word |= std::uint64_t{1} << (i & 63);
      if (!was_zero) return;  // the levels above already know this word is non-zero
      i >>= 6;
    }
  }
  void clear(std::size_t i) noexcept {
    for (auto& bits : levels_) {
      std::uint64_t& word = bits[i >> 6];
      word &= ~(std::uint64_t{1} << (i & 63));
      if (word != 0) return;
      i >>= 6;
    }
  }
  bool test(std::size_t i) const noexcept {
    return i < size_ && (levels_[0][i >> 6] >> (i & 63) & 1u);
  }
  // The first set bit >= i, or npos.
  std::size_t find_next(std::size_t i) const noexcept {
    if (i >= size_) return npos;
    // Fast path: a set bit in i's own word (exact and near fits).
    const std::uint64_t here = levels_[0][i >> 6] & (~std::uint64_t{0} << (i & 63));
    if (here != 0) return (i & ~std::size_t{63}) + static_cast<std::size_t>(__builtin_ctzll(here));
    return find(0, i);
  }

 private:
  std::size_t find(std::size_t level, std::size_t i) const noexcept;

  std::size_t size_ = 0;
  std::vector<std::vector<std::uint64_t>> levels_;
};

// The hooks a Node needs: `Node* bucket_prev; Node* bucket_next; std::size_t bucket;`.
template <typename Node>
class SizeBuckets {
 public:
  static constexpr std::size_t npos = HierarchicalBitmap::npos;

  // Makes room for sizes up to `units`, so that insert() of them never allocates. Allocates.
  void reserve(std::size_t units) {
    if (units < heads_.size()) return;
    const std::size_t n = units + 1 > 2 * heads_.size() ? units + 1 : 2 * heads_.size();
    nonempty_.grow(n);
    heads_.resize(n, nullptr);
  }

  // Adds `node` to the list of `units`, at the front (the most recently freed is reused first:
  // it is the likeliest to be warm and to share the caller's stream). Allocates only for a
  // size beyond reserve().
  void insert(Node* node, std::size_t units) {
    if (units >= heads_.size()) reserve(units);
    node->bucket = units;
    node->bucket_prev = nullptr;
    node->bucket_next = heads_[units];
    if (heads_[units] != nullptr) heads_[units]->bucket_prev = node;
    else nonempty_.set(units);
    heads_[units] = node;
    ++count_;
  }

  void remove(Node* node) noexcept {
    if (node->bucket_prev != nullptr) node->bucket_prev->bucket_next = node->bucket_next;
    else heads_[node->bucket] = node->bucket_next;
    if (node->bucket_next != nullptr) node->bucket_next->bucket_prev = node->bucket_prev;
    if (heads_[node->bucket] == nullptr) nonempty_.clear(node->bucket);
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
  std::vector<Node*> heads_;
  HierarchicalBitmap nonempty_;
  std::size_t count_ = 0;
};

}  // namespace vmalloc::detail
