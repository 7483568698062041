// HostDevice, checked mode: the budget of guards. Each guarded run (pages made PROT_NONE)
// splits a mapping's VMA, costing up to two of the kernel mappings the process may hold
// (vm.max_map_count). Guarding every free without a bound spent them all: 100k freed 4 KiB
// blocks, each between live ones, left no mapping for the next allocation (an 8 MiB allocate
// failed with DeviceError until release_cached()). So guards are recycled, oldest first:
//
// * at most guard_runs_cap() runs at a time (a quarter of the process's mapping budget,
//   vma_limit() / 8 runs, unless HostDeviceOptions::checked_guard_runs says otherwise);
//   guarding a new run past it first opens the oldest one;
// * a mapping the program asks for (map, set_access, reserve, host_alloc) that would pass
//   the budget first opens this device's oldest guards until it fits (reserve_vmas).
//
// A recycled run's pages read again (a stale touch there no longer faults), but copies of
// freed bytes are still refused (the freed records stay), and state() counts the recycled
// runs (guards_recycled), so the weaker check is never silent.
#include <sys/mman.h>

#include <algorithm>

#include "vmalloc/device/detail/host_device_books.hpp"

namespace vmalloc {

std::size_t HostDevice::guard_runs_cap() const noexcept {
  if (checked_guard_runs_ != 0) return checked_guard_runs_;
  return std::max<std::size_t>(vma_limit() / 8, 1);
}

bool HostDevice::recycle_oldest_guard() noexcept {
  if (!checked_) return false;
  Checked& c = *checked_;
  while (!c.order.empty()) {
    const auto [lo, hi] = c.order.front();
    c.order.pop_front();
    // The runs this piece is part of now (merged with its neighbours, or cut by allocations
    // since; none when an allocation or an unmap took it): opened whole, so that no run splits.
    auto g = c.guarded.upper_bound(lo);
    if (g != c.guarded.begin() && std::prev(g)->second > lo) --g;
    bool opened = false;
    while (g != c.guarded.end() && g->first < hi) {
      if (::mprotect(reinterpret_cast<void*>(g->first), g->second - g->first,
                     PROT_READ | PROT_WRITE) != 0) {
        c.order.push_front({lo, hi});  // cannot open it: it stays guarded, and counted
        return opened;
      }
      c.bytes_guarded -= g->second - g->first;
      g = c.guarded.erase(g);
      ++c.guards_recycled;
      opened = true;
    }
    if (opened) {
      const std::size_t target = 2 * c.guarded.size();
      if (c.vmas > target) {
        return_vmas(c.vmas - target);
        c.vmas = target;
      }
      return true;
    }
  }
  return false;
}

void HostDevice::note_guard(device_ptr lo, device_ptr hi) noexcept {
  Checked& c = *checked_;
  try {
    // Pieces opened since (allocations, unmaps) stay in the queue until they reach its front;
    // when they outnumber the live ones the queue is rebuilt, so it stays O(cap).
    if (c.order.size() > 2 * std::max(c.guarded.size(), guard_runs_cap()) + 64) {
      std::deque<std::pair<device_ptr, device_ptr>> kept;
      for (const auto& [a, b] : c.order) {
        auto g = c.guarded.upper_bound(a);
        if (g != c.guarded.begin() && std::prev(g)->second > a) --g;
        if (g != c.guarded.end() && g->first < b) kept.emplace_back(a, b);
      }
      c.order.swap(kept);
    }
    c.order.emplace_back(lo, hi);
  } catch (...) {
    // Out of memory: this piece is not queued; it is opened when its pages are allocated.
  }
}

}  // namespace vmalloc
