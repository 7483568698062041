// HostDevice: checked mode. Allocators say which bytes are live (Device::note_live and
// note_freed, on every allocate and free, so on every relocating swap-out and swap-in too);
// a checked HostDevice makes every host page that held a freed byte and holds no live one
// PROT_NONE, and opens it again when an allocation takes it. A program that touches memory it
// does not own then dies with SIGSEGV and a line naming the freed allocation, on every
// allocator, instead of reading or overwriting another buffer's bytes (the packed placement
// and the caching allocator keep freed memory mapped for reuse).
//
// Why pages: mprotect is the only way host code can be made to fault, and it works on whole
// pages. A page shared by a live and a freed allocation stays open (the caching allocator
// packs small blocks 512 bytes apart): checked mode catches touches of freed pages, not every
// freed byte. Allocator accounting is untouched; only the device's protection differs.
//
// The device's own copies stay stream-ordered: a copy queued before a free (a swap-out's copy
// to host, then the free) still runs, reading through the memfd rather than the guarded
// pages; a copy asked for after the free touches freed bytes and is refused at the call.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/host_device_books.hpp"
#include "vmalloc/device/detail/memfd_arena.hpp"

namespace vmalloc {

using detail::address_range;
using detail::hex;

namespace {

// ---- the fault reporter: the last frees, readable from a signal handler ----

// Plain words written and read without locks: a torn entry only spoils a message.
constexpr std::size_t recent_frees = 4096;
std::atomic<std::uintptr_t> recent_lo[recent_frees];
std::atomic<std::uintptr_t> recent_hi[recent_frees];
std::atomic<std::size_t> recent_next{0};
struct sigaction previous_segv;
struct sigaction previous_bus;
std::once_flag reporter_once;

void remember_free(std::uintptr_t lo, std::uintptr_t hi) noexcept {
  const std::size_t i = recent_next.fetch_add(1, std::memory_order_relaxed) % recent_frees;
  recent_lo[i].store(0, std::memory_order_relaxed);
  recent_hi[i].store(hi, std::memory_order_relaxed);
  recent_lo[i].store(lo, std::memory_order_release);
}

// Async-signal-safe formatting: write(2) and digits by hand.
void put(const char* s) noexcept {
  ssize_t r = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)r;
}
void put_hex(std::uintptr_t v) noexcept {
  char buf[2 + 16 + 1];
  char* p = buf + sizeof buf - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v & 15];
    v >>= 4;
  } while (v != 0);
  *--p = 'x';
  *--p = '0';
  put(p);
}
void put_dec(std::uintptr_t v) noexcept {
  char buf[24];
  char* p = buf + sizeof buf - 1;
  *p = '\0';
  do {
    *--p = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  put(p);
}

// Says which freed allocation a fault hit, then hands the fault to whoever handled it before
// (Python's faulthandler prints the traceback; the default kills with SIGSEGV): the handler is
// put back first and the faulting access runs again on return.
void report_fault(int sig, siginfo_t* info, void*) {
  ::sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
  if (info == nullptr || info->si_code <= 0) return;  // sent by kill/raise, not a touch
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  const std::size_t next = recent_next.load(std::memory_order_relaxed);
  for (std::size_t k = 0; k < recent_frees && k < next; ++k) {
    const std::size_t i = (next - 1 - k) % recent_frees;
    const std::uintptr_t lo = recent_lo[i].load(std::memory_order_acquire);
    const std::uintptr_t hi = recent_hi[i].load(std::memory_order_relaxed);
    if (lo == 0 || addr < (lo & ~std::uintptr_t{4095}) || addr >= ((hi + 4095) & ~std::uintptr_t{4095}))
      continue;
    put("vmalloc: checked HostDevice: the program touched ");
    put_hex(addr);
    put(addr >= lo && addr < hi ? ", inside " : ", on a page of ");
    put("the allocation [");
    put_hex(lo);
    put(", ");
    put_hex(hi);
    put(") (");
    put_dec(hi - lo);
    put(" bytes) that its allocator freed or a swap moved: a use after free, or a buffer "
        "the program did not list\n");
    return;
  }
}

void install_fault_reporter() {
  std::call_once(reporter_once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = report_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &previous_segv);
    ::sigaction(SIGBUS, &sa, &previous_bus);
  });
}

// ---- disjoint interval maps ----

// Whether a live allocation has a byte in [lo, hi) (live allocations are disjoint).
bool live_in(const std::map<device_ptr, std::size_t>& live, device_ptr lo, device_ptr hi) {
  auto it = live.lower_bound(hi);
  if (it == live.begin()) return false;
  --it;
  return it->first + it->second > lo;
}

// Removes every live record overlapping [lo, hi): stale (an allocator torn down with live
// allocations), since an allocator just handed these bytes out.
void drop_live(std::map<device_ptr, std::size_t>& live, device_ptr lo, device_ptr hi) {
  auto it = live.lower_bound(lo);
  if (it != live.begin() && std::prev(it)->first + std::prev(it)->second > lo) --it;
  while (it != live.end() && it->first < hi) it = live.erase(it);
}

// Removes [lo, hi) from a map of disjoint intervals keyed by start: `end(v)` reads an
// interval's end, `with_end(v, e)` makes a copy ending at e. Pieces outside stay.
template <class V, class End, class WithEnd>
void cut(std::map<device_ptr, V>& m, device_ptr lo, device_ptr hi, End end, WithEnd with_end) {
  auto it = m.lower_bound(lo);
  if (it != m.begin() && end(std::prev(it)->second) > lo) --it;
  while (it != m.end() && it->first < hi) {
    const device_ptr start = it->first;
    const V v = it->second;
    it = m.erase(it);
    if (start < lo) m.emplace(start, with_end(v, lo));
    if (end(v) > hi) {
      m.emplace(hi, v);
      break;
    }
  }
}

// The first interval overlapping [lo, hi), or end().
template <class V, class End>
typename std::map<device_ptr, V>::const_iterator first_overlap(const std::map<device_ptr, V>& m,
                                                               device_ptr lo, device_ptr hi,
                                                               End end) {
  auto it = m.upper_bound(lo);
  if (it != m.begin() && end(std::prev(it)->second) > lo) return std::prev(it);
  if (it != m.end() && it->first < hi) return it;
  return m.end();
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void HostDevice::start_checking() {
  checked_ = std::make_unique<Checked>();
  checks_liveness_ = true;
  install_fault_reporter();
}

void HostDevice::on_live(device_ptr ptr, std::size_t nbytes) noexcept {
  if (ptr == 0 || nbytes == 0) return;
  std::unique_lock<std::shared_mutex> lock(mutex_);
  Checked& c = *checked_;
  const device_ptr end = ptr + nbytes;
  const device_ptr lo = ptr & ~(page_size_ - 1);
  const device_ptr hi = (end + page_size_ - 1) & ~(page_size_ - 1);
  // Open the guarded pages first: a live byte must never fault, whatever else fails.
  auto g = first_overlap(c.guarded, lo, hi, [](device_ptr e) { return e; });
  while (g != c.guarded.end() && g->first < hi) {
    const device_ptr a = std::max(lo, g->first), b = std::min(hi, g->second);
    if (::mprotect(reinterpret_cast<void*>(a), b - a, PROT_READ | PROT_WRITE) != 0) {
      const int err = errno;
      std::fprintf(stderr,
                   "vmalloc: checked HostDevice %s: cannot open %s for a new allocation: %s\n",
                   name().c_str(), address_range(a, b - a).c_str(), std::strerror(err));
      std::abort();  // the allocation would fault: fail here, loudly, rather than later
    }
    c.bytes_guarded -= b - a;
    ++g;
  }
  try {
    cut(c.guarded, lo, hi, [](device_ptr e) { return e; },
        [](device_ptr, device_ptr e) { return e; });
  } catch (...) {
    // Out of memory splitting a run: the pieces outside [lo, hi) stay guarded but untracked
    // (still freed memory); they fault until unmapped.
  }
  const std::size_t target = 2 * c.guarded.size();
  if (target > c.vmas) reserve_vmas_unchecked(target - c.vmas);
  else return_vmas(c.vmas - target);
  c.vmas = target;
  try {
    drop_live(c.live, ptr, end);
    c.live.emplace(ptr, nbytes);
    cut(c.freed, ptr, end, [](const Checked::Freed& f) { return f.end; },
        [](Checked::Freed f, device_ptr e) {
          f.end = e;
          return f;
        });
  } catch (...) {
    // Out of memory: this allocation's free will not be guarded; nothing else changes.
  }
}

void HostDevice::on_freed(device_ptr ptr) noexcept {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  Checked& c = *checked_;
  auto it = c.live.find(ptr);
  if (it == c.live.end()) return;
  const std::size_t size = it->second;
  const device_ptr end = ptr + size;
  c.live.erase(it);
  remember_free(ptr, end);
  try {
    auto end_of = [](const Checked::Freed& f) { return f.end; };
    cut(c.freed, ptr, end, end_of, [](Checked::Freed f, device_ptr e) {
      f.end = e;
      return f;
    });
    c.freed.emplace(ptr, Checked::Freed{end, ptr, size});
  } catch (...) {
  }
  guard_freed(ptr & ~(page_size_ - 1), (end + page_size_ - 1) & ~(page_size_ - 1));
}

void HostDevice::guard_freed(device_ptr lo, device_ptr hi) noexcept {
  Checked& c = *checked_;
  bool left_open = false;
  auto end_of = [](const Checked::Freed& f) { return f.end; };
  for (auto f = first_overlap(c.freed, lo, hi, end_of); f != c.freed.end() && f->first < hi;
       ++f) {
    // The freed bytes' pages in [lo, hi); of those only the edge pages can hold a live byte.
    device_ptr plo = std::max(lo, f->first & ~(page_size_ - 1));
    device_ptr phi = std::min(hi, (f->second.end + page_size_ - 1) & ~(page_size_ - 1));
    if (plo < phi && live_in(c.live, plo, plo + page_size_)) plo += page_size_;
    if (plo < phi && live_in(c.live, phi - page_size_, phi)) phi -= page_size_;
    if (plo >= phi) continue;
    // Guard the accessible parts (a swapped-out range is unmapped: nothing to guard there).
    auto m = mappings_.upper_bound(plo);
    if (m != mappings_.begin()) --m;
    for (; m != mappings_.end() && m->first < phi; ++m) {
      for (const auto& [alo, ahi] : m->second.access) {
        const device_ptr a = std::max(plo, m->first + alo), b = std::min(phi, m->first + ahi);
        if (a >= b) continue;
        // At the cap, the oldest run opens first (host_device_guards.cpp).
        while (c.guarded.size() >= guard_runs_cap() && recycle_oldest_guard()) {
        }
        try {
          reserve_vmas(2, DriverCall::set_access);  // a run splits its VMA in three at most
        } catch (...) {
          left_open = true;  // the process's VMA budget is spent: leave it open, count it
          continue;
        }
        if (::mprotect(reinterpret_cast<void*>(a), b - a, PROT_NONE) != 0) {
          return_vmas(2);
          left_open = true;
          continue;
        }
        c.vmas += 2;
        // Merge with touching runs (several frees side by side make one run).
        device_ptr glo = a, ghi = b;
        try {
          auto g = c.guarded.lower_bound(glo);
          if (g != c.guarded.begin() && std::prev(g)->second >= glo) --g;
          while (g != c.guarded.end() && g->first <= ghi) {
            glo = std::min(glo, g->first);
            ghi = std::max(ghi, g->second);
            c.bytes_guarded -= g->second - g->first;
            g = c.guarded.erase(g);
          }
          c.guarded.emplace(glo, ghi);
          c.bytes_guarded += ghi - glo;
          note_guard(a, b);
        } catch (...) {
          ::mprotect(reinterpret_cast<void*>(a), b - a, PROT_READ | PROT_WRITE);
          left_open = true;
        }
      }
    }
  }
  if (left_open) ++c.unguarded_frees;
  const std::size_t target = 2 * c.guarded.size();
  if (c.vmas > target) {
    return_vmas(c.vmas - target);
    c.vmas = target;
  }
}

void HostDevice::checked_forget(device_ptr ptr, std::size_t size, bool reservation) noexcept {
  Checked& c = *checked_;
  const device_ptr end = ptr + size;
  try {
    auto g = first_overlap(c.guarded, ptr, end, [](device_ptr e) { return e; });
    for (; g != c.guarded.end() && g->first < end; ++g)
      c.bytes_guarded -= std::min(end, g->second) - std::max(ptr, g->first);
    cut(c.guarded, ptr, end, [](device_ptr e) { return e; },
        [](device_ptr, device_ptr e) { return e; });
    if (reservation) {
      cut(c.freed, ptr, end, [](const Checked::Freed& f) { return f.end; },
          [](Checked::Freed f, device_ptr e) {
            f.end = e;
            return f;
          });
      drop_live(c.live, ptr, end);
    }
  } catch (...) {
  }
  const std::size_t target = 2 * c.guarded.size();
  if (c.vmas > target) {
    return_vmas(c.vmas - target);
    c.vmas = target;
  }
}

void HostDevice::checked_reguard(device_ptr ptr, std::size_t size) noexcept {
  const Checked& c = *checked_;
  const device_ptr end = ptr + size;
  auto g = first_overlap(c.guarded, ptr, end, [](device_ptr e) { return e; });
  for (; g != c.guarded.end() && g->first < end; ++g) {
    const device_ptr a = std::max(ptr, g->first), b = std::min(end, g->second);
    ::mprotect(reinterpret_cast<void*>(a), b - a, PROT_NONE);
  }
  // Freed bytes whose chunk was unmapped (stolen for another range) and is mapped again.
  guard_freed(ptr, end);
}

std::string HostDevice::checked_refusal(device_ptr ptr, std::size_t n) const {
  const Checked& c = *checked_;
  auto f = first_overlap(c.freed, ptr, ptr + n, [](const Checked::Freed& x) { return x.end; });
  if (f == c.freed.end()) return {};
  return "address " + hex(std::max(ptr, f->first)) + " is in the allocation " +
         address_range(f->second.allocation, f->second.allocation_size) +
         " that its allocator freed or a swap moved (checked mode refuses copies touching "
         "memory no live allocation holds)";
}

bool HostDevice::checked_guarded(device_ptr ptr, std::size_t n) const noexcept {
  const Checked& c = *checked_;
  return first_overlap(c.guarded, ptr, ptr + n, [](device_ptr e) { return e; }) !=
         c.guarded.end();
}

void HostDevice::memfd_io(device_ptr ptr, unsigned char* buf, std::size_t n, bool write) const {
  // Every byte is mapped (checked by the caller under the same lock).
  auto m = mappings_.upper_bound(ptr);
  --m;
  std::size_t done = 0;
  while (done < n) {
    const device_ptr at = ptr + done;
    while (m->first + m->second.size <= at) ++m;
    const std::size_t k = std::min(n - done, static_cast<std::size_t>(m->first + m->second.size - at));
    off_t off = static_cast<off_t>(physical_.at(m->second.handle).offset + (at - m->first));
    std::size_t moved = 0;
    while (moved < k) {
      const ssize_t r = write ? ::pwrite(arena_->fd(), buf + done + moved, k - moved, off)
                              : ::pread(arena_->fd(), buf + done + moved, k - moved, off);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        throw DeviceError(name() + ": checked mode's copy through the memfd failed at " +
                              hex(at + moved) + ": " + std::strerror(r < 0 ? errno : EIO),
                          "cuMemcpy", cu_result::unknown);
      moved += static_cast<std::size_t>(r);
      off += r;
    }
    done += k;
  }
}

}  // namespace vmalloc
