// The free holes of the packed allocator, indexed for best fit by (size, address).
//
// Holes up to `exact_units` blocks of 512 bytes sit in exact-size buckets (SizeBuckets: best
// fit in a few find-first-set steps, no heap on the hit path). Larger holes, few by nature
// (a reservation's untouched tail, the space of a freed huge tensor), sit in one intrusive
// list scanned in full. Not thread-safe: the allocator's mutex guards it.
#pragma once

#include <cstddef>

#include "vmalloc/chunks/detail/packed_space.hpp"
#include "vmalloc/base/detail/size_buckets.hpp"
#include "vmalloc/chunks/detail/stream_order.hpp"

namespace vmalloc::detail {

class HoleIndex {
 public:
  // Holes in one exact bucket examined for one the caller's stream may use at once.
  static constexpr int scan = 8;

  explicit HoleIndex(std::size_t exact_units) : exact_(exact_units) {
    buckets_.reserve(exact_units);  // so insert() never allocates
  }

  void insert(PackedBlock* b) noexcept {
    const std::size_t units = b->size / packed_block_bytes;
    if (units < exact_) {
      buckets_.insert(b, units);
    } else {
      b->bucket = exact_;
      b->bucket_prev = nullptr;
      b->bucket_next = large_;
      if (large_ != nullptr) large_->bucket_prev = b;
      large_ = b;
      ++large_count_;
    }
    ++count_;
  }

  void remove(PackedBlock* b) noexcept {
    if (b->bucket < exact_) {
      buckets_.remove(b);
    } else {
      if (b->bucket_prev != nullptr) b->bucket_prev->bucket_next = b->bucket_next;
      else large_ = b->bucket_next;
      if (b->bucket_next != nullptr) b->bucket_next->bucket_prev = b->bucket_prev;
      b->bucket_prev = b->bucket_next = nullptr;
      --large_count_;
    }
    --count_;
  }

  // Puts `b` (not indexed) in the place of the indexed hole `old`, which leaves the index:
  // a split's remainder or a merged hole. Two large holes swap places in the list (the
  // common case of carving from and merging back into a reservation's tail).
  void replace(PackedBlock* old, PackedBlock* b) noexcept {
    if (old->bucket < exact_ || b->size / packed_block_bytes < exact_) {
      remove(old);
      insert(b);
      return;
    }
    b->bucket = exact_;
    b->bucket_prev = old->bucket_prev;
    b->bucket_next = old->bucket_next;
    if (b->bucket_prev != nullptr) b->bucket_prev->bucket_next = b;
    else large_ = b;
    if (b->bucket_next != nullptr) b->bucket_next->bucket_prev = b;
    old->bucket_prev = old->bucket_next = nullptr;
  }

  // The best hole of at least `units` blocks: the smallest; among equal sizes one that
  // `stream` may use at once, then the lowest address. nullptr if none fits.
  //
  // `unmapped(b)` counts the slots a block placed at b's start would have to map. If the
  // best exact-size fit needs some, the next `scan` sizes up are tried for a hole that
  // needs none (and is as usable on `stream`): a hole a little larger on chunks already
  // mapped costs no memory now, where the best fit would steal a chunk from elsewhere, and
  // a repeating step would then steal it back (remapping every step). Larger holes than the
  // exact buckets are not tried: that would break up a reservation's tail.
  template <typename Unmapped>
  PackedBlock* best_fit(std::size_t units, stream_t stream, Unmapped&& unmapped) const {
    if (units < exact_ && !buckets_.empty()) {  // no bitmap search while no hole is bucketed
      const std::size_t u = buckets_.best_fit(units);
      if (u != buckets_.npos) {
        PackedBlock* best = best_in(u, stream);
        if (unmapped(best) == 0) return best;
        const bool usable = StreamOrder::free_on(best->work, stream);
        int k = 0;
        for (std::size_t v = buckets_.best_fit(u + 1); v != buckets_.npos && k < scan;
             v = buckets_.best_fit(v + 1), ++k) {
          PackedBlock* b = best_in(v, stream);
          if ((!usable || StreamOrder::free_on(b->work, stream)) && unmapped(b) == 0) return b;
        }
        return best;
      }
    }
    PackedBlock* best = nullptr;
    for (PackedBlock* b = large_; b != nullptr; b = b->bucket_next) {
      if (b->size / packed_block_bytes < units) continue;
      if (best == nullptr || b->size < best->size ||
          (b->size == best->size && better(b, best, stream)))
        best = b;
    }
    return best;
  }

  std::size_t count() const noexcept { return count_; }
  std::size_t large_count() const noexcept { return large_count_; }

  template <typename F>
  void for_each(F&& f) const {
    buckets_.for_each(f);
    for (PackedBlock* b = large_; b != nullptr; b = b->bucket_next) f(b);
  }

 private:
  // The best of the first `scan` holes of exact size `u` (non-empty).
  PackedBlock* best_in(std::size_t u, stream_t stream) const noexcept {
    PackedBlock* best = nullptr;
    int n = 0;
    for (PackedBlock* b = buckets_.head(u); b != nullptr && n < scan; b = b->bucket_next, ++n)
      if (best == nullptr || better(b, best, stream)) best = b;
    return best;
  }

  // Same size: usable at once on `stream` first, then the lower address (packs low, so
  // that the top of the space empties and its chunks can be stolen).
  static bool better(const PackedBlock* a, const PackedBlock* b, stream_t stream) noexcept {
    const bool ua = StreamOrder::free_on(a->work, stream);
    const bool ub = StreamOrder::free_on(b->work, stream);
    if (ua != ub) return ua;
    return address(a) < address(b);
  }
  static device_ptr address(const PackedBlock* b) noexcept;

  const std::size_t exact_;
  SizeBuckets<PackedBlock> buckets_;
  PackedBlock* large_ = nullptr;
  std::size_t large_count_ = 0;
  std::size_t count_ = 0;
};

inline device_ptr HoleIndex::address(const PackedBlock* b) noexcept {
  return b->reservation->base + b->offset;
}

}  // namespace vmalloc::detail
