// HostDevice's books: the records behind its bookkeeping maps, shared by the files that
// implement HostDevice one concern each (src/device/host_device*.cpp). Every member here is
// read and written under HostDevice::mutex_.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/host_device.hpp"

namespace vmalloc {

namespace detail {

// "[0x1000, 0x3000)": a half-open address range for error messages.
inline std::string address_range(std::uintptr_t ptr, std::size_t size) {
  return "[" + hex(ptr) + ", " + hex(ptr + size) + ")";
}

inline bool is_pow2(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

}  // namespace detail

struct HostDevice::Physical {
  std::size_t size = 0;
  std::uint64_t offset = 0;  // in the memfd (backed only)
  std::size_t mappings = 0;
  bool released = false;
};

struct HostDevice::Reservation {
  std::size_t size = 0;
};

// Disjoint, merged [offset, end) intervals of a mapping. Nearly always one (access set over
// the whole mapping, or none): that one is kept inline, so that mapping and setting access on
// a chunk allocates nothing for it (a node per chunk was a tenth of a simulated plan's time);
// two or more live in `many_`, sorted. Read-only iteration yields (lo, hi) pairs.
class HostDeviceAccessIntervals {
 public:
  using Interval = std::pair<std::size_t, std::size_t>;

  bool empty() const noexcept { return n_ == 0; }
  std::size_t size() const noexcept { return n_; }
  const Interval* begin() const noexcept { return n_ <= 1 ? &one_ : many_.data(); }
  const Interval* end() const noexcept { return begin() + n_; }
  const Interval& front() const noexcept { return *begin(); }
  const Interval& back() const noexcept { return *(end() - 1); }

  // Whether adding [lo, hi) leaves one interval (the usual case: no intervals yet, or one that
  // [lo, hi) touches), and which: then set_one() applies it and cannot fail.
  bool merged_one(std::size_t lo, std::size_t hi, Interval* out) const noexcept {
    if (n_ == 0) {
      *out = {lo, hi};
      return true;
    }
    if (n_ == 1 && one_.first <= hi && lo <= one_.second) {
      *out = {std::min(lo, one_.first), std::max(hi, one_.second)};
      return true;
    }
    return false;
  }
  void set_one(const Interval& i) noexcept {  // after merged_one(): many_ is empty
    one_ = i;
    n_ = 1;
  }

  // Adds [lo, hi), merging what it touches. Strong guarantee: a bad_alloc (from the rare
  // path with several intervals) changes nothing.
  void add(std::size_t lo, std::size_t hi) {
    if (n_ == 0) {
      one_ = {lo, hi};
      n_ = 1;
      return;
    }
    if (n_ == 1 && one_.first <= hi && lo <= one_.second) {
      one_ = {std::min(lo, one_.first), std::max(hi, one_.second)};
      return;
    }
    std::vector<Interval> out;
    out.reserve(n_ + 1);
    bool placed = false;
    for (const Interval& i : *this) {
      if (i.second < lo) {
        out.push_back(i);
      } else if (i.first > hi) {
        if (!placed) out.emplace_back(lo, hi);
        placed = true;
        out.push_back(i);
      } else {
        lo = std::min(lo, i.first);
        hi = std::max(hi, i.second);
      }
    }
    if (!placed) out.emplace_back(lo, hi);
    n_ = out.size();
    if (n_ == 1) {
      one_ = out.front();
      many_.clear();
    } else {
      many_ = std::move(out);
    }
  }

 private:
  Interval one_{0, 0};
  std::vector<Interval> many_;
  std::size_t n_ = 0;
};

// A mapping and which of its bytes have access set (normally one interval covering the
// whole mapping).
struct HostDevice::Mapping {
  std::size_t size = 0;
  physical_handle handle = 0;
  HostDeviceAccessIntervals access;
  // handle's record in physical_: it outlives its mappings, and an unordered_map's elements
  // stay put when it rehashes, so unmap needs no lookup per chunk.
  Physical* physical = nullptr;
  // The first offset in [lo, hi) without access, or hi.
  std::size_t first_inaccessible(std::size_t lo, std::size_t hi) const {
    // the last interval starting at or before lo
    const auto* it = std::upper_bound(
        access.begin(), access.end(), lo,
        [](std::size_t v, const HostDeviceAccessIntervals::Interval& i) { return v < i.first; });
    if (it == access.begin()) return lo;
    --it;
    return it->second > lo ? std::min(it->second, hi) : lo;
  }
  void add(std::size_t lo, std::size_t hi) { access.add(lo, hi); }
  std::size_t accessible_bytes() const {
    std::size_t n = 0;
    for (const auto& [lo, hi] : access) n += hi - lo;
    return n;
  }
  // Runs of equal protection: the kernel VMAs this mapping is split into (at most).
  std::size_t pieces() const {
    if (access.empty()) return 1;
    return 2 * access.size() - 1 + (access.front().first > 0 ? 1 : 0) +
           (access.back().second < size ? 1 : 0);
  }
  // Upper bound of the VMAs the mapping adds: its pieces, plus the split of the reservation.
  std::size_t vmas() const { return 1 + pieces(); }
  // vmas() were `i` its only access interval.
  std::size_t vmas_with_one(const HostDeviceAccessIntervals::Interval& i) const {
    return 2 + (i.first > 0 ? 1 : 0) + (i.second < size ? 1 : 0);
  }
};

struct HostDevice::HostBlock {
  std::size_t size = 0;  // page-rounded
};

// Checked mode's books (host_device_checked.cpp). Disjoint intervals keyed by start.
struct HostDevice::Checked {
  struct Freed {
    device_ptr end = 0;            // these bytes [key, end) were freed and not handed out since
    device_ptr allocation = 0;     // the allocation they belonged to, for messages
    std::size_t allocation_size = 0;
  };
  std::map<device_ptr, std::size_t> live;    // start -> size: what allocators said is live
  std::map<device_ptr, Freed> freed;
  std::map<device_ptr, device_ptr> guarded;  // page runs [lo, hi) made PROT_NONE, merged
  std::size_t bytes_guarded = 0;
  std::size_t vmas = 0;                      // VMAs reserved for the guards: 2 per run
  std::size_t unguarded_frees = 0;
  // Guarded pieces, oldest first, for recycling (host_device_guards.cpp); some may have been
  // opened since (skipped when they reach the front).
  std::deque<std::pair<device_ptr, device_ptr>> order;
  std::size_t guards_recycled = 0;           // runs opened to stay under the cap or budget
};

}  // namespace vmalloc
