#include "vmalloc/device/host_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/memfd_arena.hpp"
#include "vmalloc/device/detail/stream_set.hpp"

namespace vmalloc {

using detail::hex;
using detail::human_bytes;

namespace {

std::string range(std::uintptr_t ptr, std::size_t size) {
  return "[" + hex(ptr) + ", " + hex(ptr + size) + ")";
}

bool is_pow2(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Kernel VMAs are a per-process budget (vm.max_map_count), so every HostDevice of the
// process draws from one counter. Headroom is left for the interpreter's own mappings.
constexpr std::size_t vma_headroom = 5530;
std::size_t initial_vma_limit() {
  std::size_t max_map_count = 65530;
  std::ifstream f("/proc/sys/vm/max_map_count");
  if (f) f >> max_map_count;
  return max_map_count > 2 * vma_headroom ? max_map_count - vma_headroom : max_map_count / 2;
}
std::atomic<std::size_t> vmas_held{0};
std::atomic<std::size_t> process_vma_limit{initial_vma_limit()};

// Unbacked reservations get addresses from here: far from anything the process maps.
constexpr device_ptr fake_address_base = 0x200000000000ULL;

// Copies run in pieces so that a huge copy never holds the bookkeeping lock for long.
constexpr std::size_t copy_piece = std::size_t{64} << 20;

}  // namespace

// ---------------------------------------------------------------------------------------------
// The books.

struct HostDevice::Physical {
  std::size_t size = 0;
  std::uint64_t offset = 0;  // in the memfd (backed only)
  std::size_t mappings = 0;
  bool released = false;
};

struct HostDevice::Reservation {
  std::size_t size = 0;
};

// A mapping and which of its bytes have access set: disjoint, merged [offset, end) intervals
// (normally one covering the whole mapping).
struct HostDevice::Mapping {
  std::size_t size = 0;
  physical_handle handle = 0;
  std::map<std::size_t, std::size_t> access;

  bool covers(std::size_t lo, std::size_t hi) const {
    auto it = access.upper_bound(lo);
    if (it == access.begin()) return false;
    --it;
    return it->first <= lo && it->second >= hi;
  }
  // The first offset in [lo, hi) without access, or hi.
  std::size_t first_inaccessible(std::size_t lo, std::size_t hi) const {
    auto it = access.upper_bound(lo);
    if (it == access.begin()) return lo;
    --it;
    return it->second > lo ? std::min(it->second, hi) : lo;
  }
  void add(std::size_t lo, std::size_t hi) {
    auto it = access.upper_bound(lo);
    if (it != access.begin() && std::prev(it)->second >= lo) --it;
    while (it != access.end() && it->first <= hi) {
      lo = std::min(lo, it->first);
      hi = std::max(hi, it->second);
      it = access.erase(it);
    }
    access.emplace(lo, hi);
  }
  std::size_t accessible_bytes() const {
    std::size_t n = 0;
    for (const auto& [lo, hi] : access) n += hi - lo;
    return n;
  }
  // Runs of equal protection: the kernel VMAs this mapping is split into (at most).
  std::size_t pieces() const {
    if (access.empty()) return 1;
    return 2 * access.size() - 1 + (access.begin()->first > 0 ? 1 : 0) +
           (access.rbegin()->second < size ? 1 : 0);
  }
  // Upper bound of the VMAs the mapping adds: its pieces, plus the split of the reservation.
  std::size_t vmas() const { return 1 + pieces(); }
};

struct HostDevice::HostBlock {
  std::size_t size = 0;  // page-rounded
};

struct HostDevice::CopyJob {
  DriverCall call = DriverCall::copy_device;
  device_ptr dst = 0;                 // device destination (to_device, device)
  device_ptr src = 0;                 // device source (to_host, device)
  unsigned char* host_dst = nullptr;  // to_host
  const unsigned char* host_src = nullptr;  // to_device: the caller's pinned memory or staging
  std::shared_ptr<std::vector<unsigned char>> staging;  // a pageable source's bytes
  bool host_pinned = false;           // host side is host_alloc memory: re-checked at execution
  std::size_t nbytes = 0;
};

bool HostDeviceState::operator==(const HostDeviceState& o) const noexcept {
  return physical_allocations == o.physical_allocations &&
         released_still_mapped == o.released_still_mapped && reservations == o.reservations &&
         mappings == o.mappings && bytes_created == o.bytes_created &&
         bytes_reserved == o.bytes_reserved && bytes_mapped == o.bytes_mapped &&
         bytes_accessible == o.bytes_accessible && host_allocations == o.host_allocations &&
         host_bytes == o.host_bytes && streams == o.streams && events == o.events &&
         vmas == o.vmas;
}

std::string HostDeviceState::summary() const {
  return std::to_string(physical_allocations) + " physical allocations (" +
         human_bytes(bytes_created) + ", " + std::to_string(released_still_mapped) +
         " released but still mapped), " + std::to_string(reservations) + " reservations (" +
         human_bytes(bytes_reserved) + "), " + std::to_string(mappings) + " mappings (" +
         human_bytes(bytes_mapped) + ", " + human_bytes(bytes_accessible) + " accessible)";
}

// ---------------------------------------------------------------------------------------------

HostDevice::HostDevice(const HostDeviceOptions& options)
    : capacity_(options.capacity),
      granularity_(options.granularity),
      page_size_(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))),
      backed_(options.backed),
      ordinal_(options.ordinal),
      next_fake_address_(fake_address_base) {
  // page_size_ is a power of two, so this is "a power-of-two multiple of the page size".
  if (!is_pow2(granularity_) || granularity_ < page_size_)
    throw InvalidArgument("HostDevice granularity " + std::to_string(granularity_) +
                          " is not a power-of-two multiple of the host page size " +
                          std::to_string(page_size_));
  if (granularity_ > max_request_bytes)
    throw InvalidArgument("HostDevice granularity " + std::to_string(granularity_) +
                          " is larger than vmalloc's limit of 2**56 bytes");
  if (ordinal_ < 0)
    throw InvalidArgument("HostDevice ordinal " + std::to_string(ordinal_) +
                          " must not be negative");
  if (backed_) arena_ = std::make_unique<detail::MemfdArena>("vmalloc-" + name());
  streams_ = std::make_unique<detail::StreamSet>(name());
}

HostDevice::~HostDevice() {
  // Queued work finishes first (it may touch the memory unmapped below); its faults are
  // nobody's to report any more.
  streams_.reset();
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (backed_) {
    for (const auto& [base, r] : reservations_) ::munmap(reinterpret_cast<void*>(base), r.size);
  }
  for (const auto& [base, b] : host_blocks_) ::munmap(reinterpret_cast<void*>(base), b.size);
  return_vmas(vmas_);
  arena_.reset();  // closes the memfd: every page goes back to the OS
}

std::string HostDevice::name() const { return "host:" + std::to_string(ordinal_); }

std::size_t HostDevice::physical_bytes_in_use() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return bytes_created_;
}

void HostDevice::fail(DriverCall call, const std::string& rule, int code) const {
  const char* entry = driver_call_entry_point(call);
  throw DeviceError(std::string(entry) + " on " + name() + ": " + rule, entry, code);
}

std::size_t HostDevice::vma_limit() noexcept { return process_vma_limit.load(); }
void HostDevice::set_vma_limit(std::size_t limit) noexcept { process_vma_limit.store(limit); }
std::size_t HostDevice::process_vmas() noexcept { return vmalloc::vmas_held.load(); }

void HostDevice::reserve_vmas(std::size_t more, DriverCall call) {
  if (!backed_ || more == 0) return;
  std::size_t current = vmas_held.load();
  do {
    const std::size_t limit = process_vma_limit.load();
    if (current + more > limit)
      fail(call,
           "the process would hold more than " + std::to_string(limit) +
               " memory mappings (vm.max_map_count minus headroom; " +
               std::to_string(current) + " held by emulated devices): use a larger " +
               "granularity or fewer, larger chunks",
           cu_result::out_of_memory);
  } while (!vmas_held.compare_exchange_weak(current, current + more));
  vmas_ += more;
}

void HostDevice::return_vmas(std::size_t fewer) noexcept {
  if (!backed_ || fewer == 0) return;
  vmas_held.fetch_sub(fewer);
  vmas_ -= fewer;
}

HostDeviceState HostDevice::state_locked() const {
  HostDeviceState s;
  s.physical_allocations = physical_.size();
  s.released_still_mapped = released_still_mapped_;
  s.reservations = reservations_.size();
  s.mappings = mappings_.size();
  s.bytes_created = bytes_created_;
  s.bytes_reserved = bytes_reserved_;
  s.bytes_mapped = bytes_mapped_;
  s.bytes_accessible = bytes_accessible_;
  s.host_allocations = host_blocks_.size();
  s.host_bytes = host_bytes_;
  s.vmas = vmas_;
  return s;
}

HostDeviceState HostDevice::state() const {
  HostDeviceState s;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    s = state_locked();
  }
  s.streams = streams_->streams();
  s.events = streams_->events();
  return s;
}

std::string HostDevice::state_line_locked() const {
  return name() + ": " + state_locked().summary() +
         (capacity_ ? ", capacity " + human_bytes(capacity_)
                    : std::string(", capacity unlimited"));
}

// ---------------------------------------------------------------------------------------------
// Physical memory.

physical_handle HostDevice::create(std::size_t size) {
  count(DriverCall::create);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || size % granularity_ != 0)
    fail(DriverCall::create,
         "size " + std::to_string(size) + " is not a positive multiple of the granularity " +
             std::to_string(granularity_),
         cu_result::invalid_value);
  if (size > max_request_bytes)
    fail(DriverCall::create,
         "size " + std::to_string(size) + " is larger than vmalloc's limit of 2**56 bytes",
         cu_result::invalid_value);
  if (capacity_ != 0 && size > capacity_ - std::min(capacity_, bytes_created_))
    throw OutOfMemory("cuMemCreate on " + name() + ": cannot create " + human_bytes(size) +
                          ": " + human_bytes(bytes_created_) + " of the capacity " +
                          human_bytes(capacity_) + " are in use",
                      size, state_line_locked());
  const std::uint64_t offset = backed_ ? arena_->allocate(size) : 0;
  const physical_handle handle = next_handle_++;
  physical_.emplace(handle, Physical{size, offset, 0, false});
  bytes_created_ += size;
  return handle;
}

void HostDevice::free_physical(std::map<physical_handle, Physical>::iterator it) noexcept {
  if (backed_) arena_->deallocate(it->second.offset, it->second.size);
  bytes_created_ -= it->second.size;
  if (it->second.released) --released_still_mapped_;
  physical_.erase(it);
}

void HostDevice::release(physical_handle handle) {
  count(DriverCall::release);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto it = physical_.find(handle);
  if (it == physical_.end() || it->second.released)
    fail(DriverCall::release, "unknown or already released handle " + hex(handle),
         cu_result::invalid_value);
  if (it->second.mappings > 0) {  // freed when its last mapping goes
    it->second.released = true;
    ++released_still_mapped_;
  } else {
    free_physical(it);
  }
}

// ---------------------------------------------------------------------------------------------
// Address space.

HostDevice::Reservation* HostDevice::reservation_containing(device_ptr ptr, std::size_t size) {
  auto it = reservations_.upper_bound(ptr);
  if (it == reservations_.begin()) return nullptr;
  --it;
  const device_ptr end = it->first + it->second.size;
  if (ptr >= end || size > end - ptr) return nullptr;
  return &it->second;
}

device_ptr HostDevice::reserve(std::size_t size, std::size_t alignment) {
  count(DriverCall::reserve);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || size % page_size_ != 0)
    fail(DriverCall::reserve,
         "size " + std::to_string(size) + " is not a positive multiple of the host page size " +
             std::to_string(page_size_),
         cu_result::invalid_value);
  if (alignment != 0 && !is_pow2(alignment))
    fail(DriverCall::reserve,
         "alignment " + std::to_string(alignment) + " is neither 0 nor a power of two",
         cu_result::invalid_value);
  if (size > max_request_bytes || alignment > max_request_bytes)
    fail(DriverCall::reserve,
         "size " + std::to_string(size) + " or alignment " + std::to_string(alignment) +
             " is larger than vmalloc's limit of 2**56 bytes",
         cu_result::invalid_value);
  // Mapped addresses must be granularity-aligned, so reservations always are.
  const std::size_t align = std::max(alignment, granularity_);
  device_ptr base = 0;
  if (backed_) {
    reserve_vmas(1, DriverCall::reserve);
    // Over-reserve by the alignment and trim both ends: mmap only promises page alignment.
    const std::size_t total = size + align;
    void* raw = ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
    if (raw == MAP_FAILED) {
      const int err = errno;
      return_vmas(1);
      fail(DriverCall::reserve,
           "cannot reserve " + human_bytes(size) + " of address space: " + std::strerror(err),
           cu_result::out_of_memory);
    }
    const auto start = reinterpret_cast<device_ptr>(raw);
    base = (start + align - 1) & ~(static_cast<device_ptr>(align) - 1);
    if (base > start) ::munmap(raw, base - start);
    if (start + total > base + size)
      ::munmap(reinterpret_cast<void*>(base + size), start + total - (base + size));
  } else {
    base = (next_fake_address_ + align - 1) & ~(static_cast<device_ptr>(align) - 1);
    if (base < next_fake_address_ || base + size < base || base + size > (device_ptr{1} << 63))
      fail(DriverCall::reserve, "the emulated address space is exhausted",
           cu_result::out_of_memory);
    next_fake_address_ = base + size;
  }
  reservations_.emplace(base, Reservation{size});
  bytes_reserved_ += size;
  return base;
}

void HostDevice::free_address(device_ptr ptr, std::size_t size) {
  count(DriverCall::free_address);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto it = reservations_.find(ptr);
  if (it == reservations_.end())
    fail(DriverCall::free_address, hex(ptr) + " is not the base of a reservation",
         cu_result::invalid_value);
  if (it->second.size != size)
    fail(DriverCall::free_address,
         "size " + std::to_string(size) + " does not match the reservation at " + hex(ptr) +
             " (" + std::to_string(it->second.size) + " bytes): free exactly one whole reservation",
         cu_result::invalid_value);
  auto m = mappings_.lower_bound(ptr);
  if (m != mappings_.end() && m->first < ptr + size)
    fail(DriverCall::free_address,
         "the reservation " + range(ptr, size) + " still has a mapping at " + hex(m->first) +
             ": unmap it first",
         cu_result::invalid_value);
  if (backed_) {
    ::munmap(reinterpret_cast<void*>(ptr), size);
    return_vmas(1);
  }
  bytes_reserved_ -= size;
  reservations_.erase(it);
}

bool HostDevice::covering_mappings(device_ptr ptr, std::size_t size, bool whole_only,
                                   std::map<device_ptr, Mapping>::iterator* first,
                                   std::string* why) {
  if (size == 0) {
    *why = "size must be positive";
    return false;
  }
  if (reservation_containing(ptr, size) == nullptr) {
    *why = "the range " + range(ptr, size) + " is not inside one reservation";
    return false;
  }
  auto it = mappings_.upper_bound(ptr);
  if (it != mappings_.begin() && std::prev(it)->first + std::prev(it)->second.size > ptr) --it;
  if (it == mappings_.end() || it->first > ptr) {
    *why = "the address " + hex(ptr) + " is not mapped";
    return false;
  }
  if (whole_only && it->first != ptr) {
    *why = "the range starts inside the mapping at " + hex(it->first) + " (" +
           std::to_string(it->second.size) + " bytes): cannot unmap a sub-range of a mapping";
    return false;
  }
  *first = it;
  const device_ptr end = ptr + size;
  device_ptr cur = ptr;
  while (cur < end) {
    if (it == mappings_.end() || it->first > cur) {
      *why = "the range " + range(ptr, size) + " has a gap at " + hex(cur) +
             ": every byte must be mapped";
      return false;
    }
    const device_ptr mapping_end = it->first + it->second.size;
    if (whole_only && mapping_end > end) {
      *why = "the range ends inside the mapping at " + hex(it->first) + " (" +
             std::to_string(it->second.size) + " bytes): cannot unmap a sub-range of a mapping";
      return false;
    }
    cur = std::min(end, mapping_end);
    ++it;
  }
  return true;
}

void HostDevice::map(device_ptr ptr, std::size_t size, physical_handle handle) {
  count(DriverCall::map);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || ptr % granularity_ != 0 || size % granularity_ != 0)
    fail(DriverCall::map,
         "address " + hex(ptr) + " and size " + std::to_string(size) +
             " must be positive multiples of the granularity " + std::to_string(granularity_),
         cu_result::invalid_value);
  auto p = physical_.find(handle);
  if (p == physical_.end())
    fail(DriverCall::map, "unknown handle " + hex(handle), cu_result::invalid_value);
  if (p->second.released)
    fail(DriverCall::map, "handle " + hex(handle) + " was released: it cannot be mapped again",
         cu_result::invalid_value);
  if (size > p->second.size)
    fail(DriverCall::map,
         "size " + std::to_string(size) + " exceeds the size of allocation " + hex(handle) +
             " (" + std::to_string(p->second.size) + " bytes)",
         cu_result::invalid_value);
  if (reservation_containing(ptr, size) == nullptr)
    fail(DriverCall::map, "the range " + range(ptr, size) + " is not inside one reservation",
         cu_result::invalid_value);
  auto next = mappings_.lower_bound(ptr);
  auto overlap = mappings_.end();
  if (next != mappings_.end() && next->first < ptr + size) overlap = next;
  if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.size > ptr)
    overlap = std::prev(next);
  if (overlap != mappings_.end())
    fail(DriverCall::map,
         "the range " + range(ptr, size) + " overlaps the mapping at " + hex(overlap->first) +
             " (" + std::to_string(overlap->second.size) + " bytes): unmap it first",
         cu_result::invalid_value);
  // Recorded first, so that a bad_alloc cannot leave pages mapped that nothing tracks; taken
  // out again if the mapping fails.
  const auto slot = mappings_.emplace(ptr, Mapping{size, handle, {}}).first;
  if (backed_) {
    try {
      reserve_vmas(slot->second.vmas(), DriverCall::map);
    } catch (...) {
      mappings_.erase(slot);
      throw;
    }
    // No access yet: a mapping starts inaccessible, as on the GPU.
    void* at = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                      arena_->fd(), static_cast<off_t>(p->second.offset));
    if (at == MAP_FAILED) {
      const int err = errno;
      // A failed MAP_FIXED may have removed the old pages: put the reservation back.
      ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
      return_vmas(slot->second.vmas());
      mappings_.erase(slot);
      fail(DriverCall::map, "mmap of " + range(ptr, size) + " failed: " + std::strerror(err),
           cu_result::out_of_memory);
    }
  }
  ++p->second.mappings;
  bytes_mapped_ += size;
}

void HostDevice::unmap(device_ptr ptr, std::size_t size) {
  count(DriverCall::unmap);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  std::map<device_ptr, Mapping>::iterator it;
  std::string why;
  if (!covering_mappings(ptr, size, /*whole_only=*/true, &it, &why))
    fail(DriverCall::unmap, why, cu_result::invalid_value);
  if (backed_) {
    // The range reverts to plain reservation: PROT_NONE anonymous pages, no memory.
    void* at = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (at == MAP_FAILED) {
      const int err = errno;  // before building the message, which may change errno
      fail(DriverCall::unmap, "mmap over " + range(ptr, size) + " failed: " + std::strerror(err),
           cu_result::unknown);
    }
  }
  const device_ptr end = ptr + size;
  while (it != mappings_.end() && it->first < end) {
    const Mapping& m = it->second;
    bytes_mapped_ -= m.size;
    bytes_accessible_ -= m.accessible_bytes();
    return_vmas(m.vmas());
    auto p = physical_.find(m.handle);
    if (--p->second.mappings == 0 && p->second.released) free_physical(p);
    it = mappings_.erase(it);
  }
}

void HostDevice::set_access(device_ptr ptr, std::size_t size) {
  count(DriverCall::set_access);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || ptr % page_size_ != 0 || size % page_size_ != 0)
    fail(DriverCall::set_access,
         "address " + hex(ptr) + " and size " + std::to_string(size) +
             " must be positive multiples of the host page size " + std::to_string(page_size_),
         cu_result::invalid_value);
  std::map<device_ptr, Mapping>::iterator first;
  std::string why;
  if (!covering_mappings(ptr, size, /*whole_only=*/false, &first, &why))
    fail(DriverCall::set_access, why, cu_result::invalid_value);
  const device_ptr end = ptr + size;
  // Work out the new access sets first, so a refusal (VMA budget, mprotect) changes nothing.
  std::vector<std::pair<Mapping*, Mapping>> updates;
  std::size_t vmas_before = 0, vmas_after = 0;
  for (auto it = first; it != mappings_.end() && it->first < end; ++it) {
    Mapping updated = it->second;
    const std::size_t lo = std::max(ptr, it->first) - it->first;
    const std::size_t hi = std::min(end, it->first + it->second.size) - it->first;
    updated.add(lo, hi);
    vmas_before += it->second.vmas();
    vmas_after += updated.vmas();
    updates.emplace_back(&it->second, std::move(updated));
  }
  if (vmas_after > vmas_before) reserve_vmas(vmas_after - vmas_before, DriverCall::set_access);
  if (backed_ && ::mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    if (vmas_after > vmas_before) return_vmas(vmas_after - vmas_before);
    fail(DriverCall::set_access,
         "mprotect of " + range(ptr, size) + " failed: " + std::strerror(err),
         cu_result::out_of_memory);
  }
  if (vmas_after < vmas_before) return_vmas(vmas_before - vmas_after);
  for (auto& [mapping, updated] : updates) {
    bytes_accessible_ += updated.accessible_bytes() - mapping->accessible_bytes();
    *mapping = std::move(updated);
  }
}

std::string HostDevice::check_accessible(device_ptr ptr, std::size_t n) const {
  if (n == 0) return {};
  if (ptr + n < ptr) return "the range at " + hex(ptr) + " wraps around the address space";
  auto it = mappings_.upper_bound(ptr);
  if (it == mappings_.begin()) return "address " + hex(ptr) + " is not mapped";
  --it;
  const device_ptr end = ptr + n;
  device_ptr cur = ptr;
  while (cur < end) {
    if (it == mappings_.end() || it->first > cur || it->first + it->second.size <= cur)
      return "address " + hex(cur) + " is not mapped";
    const device_ptr mapping_end = it->first + it->second.size;
    const device_ptr hi = std::min(end, mapping_end);
    const std::size_t bad = it->second.first_inaccessible(cur - it->first, hi - it->first);
    if (it->first + bad < hi)
      return "address " + hex(it->first + bad) +
             " is mapped but not accessible (no cuMemSetAccess since it was mapped)";
    cur = hi;
    ++it;
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// Pinned host memory.

void* HostDevice::host_alloc(std::size_t size) {
  count(DriverCall::host_alloc);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (size == 0 || size > max_request_bytes)
    fail(DriverCall::host_alloc,
         "size " + std::to_string(size) + " must be positive and at most 2**56 bytes",
         cu_result::invalid_value);
  const std::size_t rounded = (size + page_size_ - 1) / page_size_ * page_size_;
  // Counted even when unbacked: the pinned memory is real host memory in both modes.
  const bool was_backed_budget = backed_;
  if (was_backed_budget) reserve_vmas(1, DriverCall::host_alloc);
  // Unbacked devices never copy bytes, so their host memory need not be committed.
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (backed_ ? 0 : MAP_NORESERVE);
  void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (was_backed_budget) return_vmas(1);
    fail(DriverCall::host_alloc,
         "cannot allocate " + human_bytes(size) + " of host memory: " + std::strerror(err),
         cu_result::out_of_memory);
  }
  host_blocks_.emplace(reinterpret_cast<std::uintptr_t>(p), HostBlock{rounded});
  host_bytes_ += rounded;
  return p;
}

void HostDevice::host_free(void* ptr) {
  count(DriverCall::host_free);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto it = host_blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == host_blocks_.end())
    fail(DriverCall::host_free,
         hex(reinterpret_cast<std::uintptr_t>(ptr)) +
             " is not pinned host memory from host_alloc (or was already freed)",
         cu_result::invalid_value);
  ::munmap(ptr, it->second.size);
  if (backed_) return_vmas(1);
  host_bytes_ -= it->second.size;
  host_blocks_.erase(it);
}

bool HostDevice::host_range_pinned(std::uintptr_t ptr, std::size_t n) const {
  auto it = host_blocks_.upper_bound(ptr);
  if (it == host_blocks_.begin()) return false;
  --it;
  const std::uintptr_t end = it->first + it->second.size;
  return ptr < end && n <= end - ptr;
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

stream_t HostDevice::create_stream() { return create_stream(false); }

stream_t HostDevice::create_stream(bool non_blocking) {
  count(DriverCall::stream_create);
  return streams_->create_stream(non_blocking);
}

void HostDevice::check_stream_alive(stream_t stream, const char* caller) const {
  if (stream != 0 && streams_->destroyed(stream))
    throw InvalidArgument(std::string(caller) + ": stream " + hex(stream) + " of " + name() +
                          " was destroyed: allocating or freeing on it is refused");
}

void HostDevice::destroy_stream(stream_t stream) {
  count(DriverCall::stream_destroy);
  streams_->destroy_stream(stream, driver_call_entry_point(DriverCall::stream_destroy));
}

event_t HostDevice::create_event() {
  count(DriverCall::event_create);
  return streams_->create_event();
}

void HostDevice::destroy_event(event_t event) {
  count(DriverCall::event_destroy);
  streams_->destroy_event(event, driver_call_entry_point(DriverCall::event_destroy));
}

void HostDevice::record_event(event_t event, stream_t stream) {
  count(DriverCall::event_record);
  streams_->record(event, stream, driver_call_entry_point(DriverCall::event_record));
}

bool HostDevice::query_event(event_t event) {
  count(DriverCall::event_query);
  return streams_->query(event, driver_call_entry_point(DriverCall::event_query));
}

void HostDevice::synchronize_event(event_t event) {
  count(DriverCall::event_synchronize);
  const char* entry = driver_call_entry_point(DriverCall::event_synchronize);
  streams_->wait_event_host(event, entry);
  streams_->report_fault(entry);
}

void HostDevice::wait_event(stream_t stream, event_t event) {
  count(DriverCall::stream_wait_event);
  streams_->stream_wait_event(stream, event, driver_call_entry_point(DriverCall::stream_wait_event));
}

void HostDevice::synchronize_stream(stream_t stream) {
  count(DriverCall::stream_synchronize);
  const char* entry = driver_call_entry_point(DriverCall::stream_synchronize);
  streams_->synchronize_stream(stream, entry);
  streams_->report_fault(entry);
}

void HostDevice::synchronize() {
  count(DriverCall::synchronize);
  streams_->synchronize_all();
  streams_->report_fault(driver_call_entry_point(DriverCall::synchronize));
}

void HostDevice::launch_host_func(stream_t stream, std::function<void()> fn) {
  if (!fn)
    throw DeviceError("cuLaunchHostFunc on " + name() + ": the function is empty",
                      "cuLaunchHostFunc", cu_result::invalid_value);
  detail::StreamSet* streams = streams_.get();
  streams_->enqueue(
      stream,
      [streams, fn = std::move(fn)] {
        try {
          fn();
        } catch (const std::exception& e) {
          streams->record_fault(std::string("a host function failed: ") + e.what());
        } catch (...) {
          streams->record_fault("a host function failed");
        }
      },
      "cuLaunchHostFunc");
}

std::uint64_t HostDevice::hold_stream(stream_t stream) {
  return streams_->hold(stream, "cuLaunchHostFunc");
}

void HostDevice::release_hold(std::uint64_t hold) {
  streams_->release_hold(hold, "HostDevice::release_hold");
}

// ---------------------------------------------------------------------------------------------
// Copies.

void HostDevice::execute_copy(const CopyJob& job) {
  const char* entry = driver_call_entry_point(job.call);
  const bool reads_device = job.call != DriverCall::copy_to_device;
  const bool writes_device = job.call != DriverCall::copy_to_host;
  // Device-to-device copies between overlapping ranges go backwards when the destination
  // is above the source, like memmove.
  const bool backwards = job.call == DriverCall::copy_device && job.dst > job.src &&
                         job.dst < job.src + job.nbytes;
  const std::size_t piece = backed_ ? copy_piece : job.nbytes;
  for (std::size_t done = 0; done < job.nbytes; done += piece) {
    const std::size_t n = std::min(piece, job.nbytes - done);
    const std::size_t off = backwards ? job.nbytes - done - n : done;
    // Shared: copies run alongside each other, never alongside a change of the map.
    std::shared_lock<std::shared_mutex> lock(mutex_);
    std::string why;
    if (reads_device) why = check_accessible(job.src + off, n);
    if (why.empty() && writes_device) why = check_accessible(job.dst + off, n);
    if (!why.empty())
      throw DeviceError(std::string(entry) + " of " + std::to_string(job.nbytes) +
                            " bytes faulted: " + why,
                        entry, cu_result::illegal_address);
    if (job.host_pinned) {
      const auto host = reinterpret_cast<std::uintptr_t>(job.host_dst ? job.host_dst
                                                                        : job.host_src);
      if (!host_range_pinned(host + off, n))
        throw DeviceError(std::string(entry) + " faulted: its pinned host memory at " +
                              hex(host) + " was freed before the copy ran",
                          entry, cu_result::illegal_address);
    }
    if (!backed_) continue;  // accounting only: nothing to move
    switch (job.call) {
      case DriverCall::copy_to_device:
        std::memcpy(reinterpret_cast<void*>(job.dst + off), job.host_src + off, n);
        break;
      case DriverCall::copy_to_host:
        std::memcpy(job.host_dst + off, reinterpret_cast<const void*>(job.src + off), n);
        break;
      default:
        std::memmove(reinterpret_cast<void*>(job.dst + off),
                     reinterpret_cast<const void*>(job.src + off), n);
        break;
    }
  }
}

void HostDevice::enqueue_copy(const CopyJob& job, stream_t stream, bool wait) {
  const char* entry = driver_call_entry_point(job.call);
  bool counted = false;
  struct CountFailure {  // a refused copy still counts as a call, without bytes
    HostDevice* self;
    DriverCall call;
    const bool& counted;
    ~CountFailure() {
      if (!counted) self->count(call);
    }
  } count_failure{this, job.call, counted};

  if ((job.call == DriverCall::copy_to_device && job.host_src == nullptr) ||
      (job.call == DriverCall::copy_to_host && job.host_dst == nullptr))
    fail(job.call, "the host pointer is null", cu_result::invalid_value);
  if (job.nbytes > max_request_bytes)
    fail(job.call,
         "size " + std::to_string(job.nbytes) + " is larger than vmalloc's limit of 2**56 bytes",
         cu_result::invalid_value);
  streams_->check_stream(stream, entry);
  CopyJob queued = job;
  if (job.nbytes > 0) {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    std::string why;
    if (job.call != DriverCall::copy_to_device) why = check_accessible(job.src, job.nbytes);
    if (why.empty() && job.call != DriverCall::copy_to_host)
      why = check_accessible(job.dst, job.nbytes);
    if (!why.empty()) fail(job.call, why, cu_result::illegal_address);
    if (job.call == DriverCall::copy_to_device)
      queued.host_pinned =
          host_range_pinned(reinterpret_cast<std::uintptr_t>(job.host_src), job.nbytes);
    else if (job.call == DriverCall::copy_to_host)
      queued.host_pinned =
          host_range_pinned(reinterpret_cast<std::uintptr_t>(job.host_dst), job.nbytes);
  }
  // As with the driver: from pageable memory an HtoD copy takes its bytes at the call (the
  // caller may reuse the buffer at once) and a DtoH copy returns only once done.
  if (backed_ && job.call == DriverCall::copy_to_device && !queued.host_pinned && job.nbytes) {
    queued.staging = std::make_shared<std::vector<unsigned char>>(job.host_src,
                                                                  job.host_src + job.nbytes);
    queued.host_src = queued.staging->data();
  }
  if (job.call == DriverCall::copy_to_host && !queued.host_pinned) wait = true;
  detail::StreamSet* streams = streams_.get();
  auto ticket = streams_->enqueue(
      stream,
      [this, streams, queued] {
        try {
          execute_copy(queued);
        } catch (const std::exception& e) {
          streams->record_fault(e.what());
        }
      },
      entry);
  counted = true;
  count_copy(job.call, job.nbytes);
  if (wait) ticket.wait();
}

void HostDevice::copy_to_device(device_ptr dst, const void* src, std::size_t nbytes,
                                stream_t stream) {
  CopyJob job;
  job.call = DriverCall::copy_to_device;
  job.dst = dst;
  job.host_src = static_cast<const unsigned char*>(src);
  job.nbytes = nbytes;
  enqueue_copy(job, stream, false);
}

void HostDevice::copy_to_host(void* dst, device_ptr src, std::size_t nbytes, stream_t stream) {
  CopyJob job;
  job.call = DriverCall::copy_to_host;
  job.src = src;
  job.host_dst = static_cast<unsigned char*>(dst);
  job.nbytes = nbytes;
  enqueue_copy(job, stream, false);
}

void HostDevice::copy_device(device_ptr dst, device_ptr src, std::size_t nbytes,
                             stream_t stream) {
  CopyJob job;
  job.call = DriverCall::copy_device;
  job.dst = dst;
  job.src = src;
  job.nbytes = nbytes;
  enqueue_copy(job, stream, false);
}

}  // namespace vmalloc
