// HostDevice: mappings and access (cuMemMap, cuMemUnmap, cuMemSetAccess). A mapping is the
// physical region of the memfd mmap'ed MAP_SHARED into its reservation, so remapping is real;
// it stays PROT_NONE until access is set.
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <new>
#include <utility>
#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/host_device_books.hpp"
#include "vmalloc/device/detail/memfd_arena.hpp"

namespace vmalloc {

using detail::address_range;
using detail::hex;

bool HostDevice::covering_mappings(device_ptr ptr, std::size_t size, bool whole_only,
                                   std::map<device_ptr, Mapping>::iterator* first,
                                   std::string* why) {
  if (size == 0) {
    *why = "size must be positive";
    return false;
  }
  if (reservation_containing(ptr, size) == nullptr) {
    *why = "the range " + address_range(ptr, size) + " is not inside one reservation";
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
      *why = "the range " + address_range(ptr, size) + " has a gap at " + hex(cur) +
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
  map_locked(ptr, size, handle, mappings_.lower_bound(ptr), /*inside=*/false);
}

void HostDevice::map_chunks(device_ptr base, std::size_t size, const physical_handle* handles,
                            std::size_t n, std::size_t& mapped) {
  if (mapped >= n) return;
  std::unique_lock<std::shared_mutex> lock(mutex_);
  // Chunk i + 1 goes right after chunk i: the mapping after the run's first address stays the
  // successor of each new one, so the tree is walked once for the run, not once per chunk.
  const auto next = mappings_.lower_bound(base + mapped * size);
  // A reservation holding the whole run holds each chunk: map's check, once for the run.
  const bool inside = size != 0 && n - mapped <= SIZE_MAX / size &&
                      reservation_containing(base + mapped * size, (n - mapped) * size);
  for (; mapped < n; ++mapped) {
    count(DriverCall::map);
    map_locked(base + mapped * size, size, handles[mapped], next, inside);
  }
}

std::map<device_ptr, HostDevice::Mapping>::iterator HostDevice::map_locked(
    device_ptr ptr, std::size_t size, physical_handle handle,
    std::map<device_ptr, Mapping>::iterator next, bool inside) {
  // An unaligned address is CUDA_ERROR_NOT_SUPPORTED on a real driver (580.159, H200,
  // scripts/gpucheck/rules.py), an unaligned size CUDA_ERROR_INVALID_VALUE.
  if (ptr % granularity_ != 0)
    fail(DriverCall::map,
         "address " + hex(ptr) + " must be a multiple of the granularity " +
             std::to_string(granularity_),
         cu_result::not_supported);
  if (size == 0 || size % granularity_ != 0)
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
  if (!inside && reservation_containing(ptr, size) == nullptr)
    fail(DriverCall::map,
         "the range " + address_range(ptr, size) + " is not inside one reservation",
         cu_result::invalid_value);
  auto overlap = mappings_.end();
  if (next != mappings_.end() && next->first < ptr + size) overlap = next;
  if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.size > ptr)
    overlap = std::prev(next);
  if (overlap != mappings_.end())
    fail(DriverCall::map,
         "the range " + address_range(ptr, size) + " overlaps the mapping at " +
             hex(overlap->first) + " (" + std::to_string(overlap->second.size) +
             " bytes): unmap it first",
         cu_result::invalid_value);
  // Recorded first, so that a bad_alloc cannot leave pages mapped that nothing tracks; taken
  // out again if the mapping fails.
  // At `next`, the caller's lower bound: no second walk down the tree (thousands of chunks
  // mapped); in a node an unmap left when there is one (no allocation).
  std::map<device_ptr, Mapping>::iterator slot;
  if (!spare_mappings_.empty()) {
    auto node = std::move(spare_mappings_.back());
    spare_mappings_.pop_back();
    node.key() = ptr;
    node.mapped() = Mapping{size, handle, {}, &p->second};
    slot = mappings_.insert(next, std::move(node));
  } else {
    slot = mappings_.emplace_hint(next, ptr, Mapping{size, handle, {}, &p->second});
  }
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
      fail(DriverCall::map,
           "mmap of " + address_range(ptr, size) + " failed: " + std::strerror(err),
           cu_result::out_of_memory);
    }
  }
  ++p->second.mappings;
  bytes_mapped_ += size;
  return slot;
}

void HostDevice::unmap(device_ptr ptr, std::size_t size) {
  count(DriverCall::unmap);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  std::map<device_ptr, Mapping>::iterator it;
  std::string why;
  if (!covering_mappings(ptr, size, /*whole_only=*/true, &it, &why))
    fail(DriverCall::unmap, why, cu_result::invalid_value);
  // Room for this run's nodes among the spares before anything changes (failing to grow it
  // only keeps fewer), so that the loop below cannot throw.
  const std::size_t want = std::min(kSpareMappings, spare_mappings_.size() + size / granularity_);
  if (spare_mappings_.capacity() < want) {
    try {
      spare_mappings_.reserve(want);
    } catch (const std::bad_alloc&) {
    }
  }
  if (backed_) {
    // The range reverts to plain reservation: PROT_NONE anonymous pages, no memory.
    void* at = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (at == MAP_FAILED) {
      const int err = errno;  // before building the message, which may change errno
      fail(DriverCall::unmap,
           "mmap over " + address_range(ptr, size) + " failed: " + std::strerror(err),
           cu_result::unknown);
    }
  }
  const device_ptr end = ptr + size;
  std::size_t vmas = 0;  // given back once: one atomic for the run, not one per chunk
  while (it != mappings_.end() && it->first < end) {
    const Mapping& m = it->second;
    bytes_mapped_ -= m.size;
    bytes_accessible_ -= m.accessible_bytes();
    vmas += m.vmas();
    if (--m.physical->mappings == 0 && m.physical->released)
      free_physical(physical_.find(m.handle));
    const auto following = std::next(it);
    if (spare_mappings_.size() < spare_mappings_.capacity())
      spare_mappings_.push_back(mappings_.extract(it));
    else
      mappings_.erase(it);
    it = following;
  }
  return_vmas(vmas);
  if (checked_) checked_forget(ptr, size, /*reservation=*/false);  // plain reservation again
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
  // Nearly always each mapping is left with one interval: kept as that interval, applied in
  // place (no copy of the mapping); otherwise as an updated copy.
  struct Update {
    Mapping* mapping;
    HostDeviceAccessIntervals::Interval merged;
  };
  std::vector<Update> updates;
  std::vector<std::pair<Mapping*, Mapping>> copies;
  // Every mapping is a multiple of the granularity: at most this many, and at most every
  // mapping there is (a 2^56-byte mapping is one, not 2^35), in one allocation.
  updates.reserve(std::min(size / granularity_ + 2, mappings_.size()));
  std::size_t vmas_before = 0, vmas_after = 0;
  for (auto it = first; it != mappings_.end() && it->first < end; ++it) {
    Mapping& m = it->second;
    const std::size_t lo = std::max(ptr, it->first) - it->first;
    const std::size_t hi = std::min(end, it->first + m.size) - it->first;
    vmas_before += m.vmas();
    HostDeviceAccessIntervals::Interval merged;
    if (m.access.merged_one(lo, hi, &merged)) {
      vmas_after += m.vmas_with_one(merged);
      updates.push_back({&m, merged});
    } else {
      Mapping updated = m;
      updated.add(lo, hi);
      vmas_after += updated.vmas();
      copies.emplace_back(&m, std::move(updated));
    }
  }
  if (vmas_after > vmas_before) reserve_vmas(vmas_after - vmas_before, DriverCall::set_access);
  if (backed_ && ::mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    if (vmas_after > vmas_before) return_vmas(vmas_after - vmas_before);
    fail(DriverCall::set_access,
         "mprotect of " + address_range(ptr, size) + " failed: " + std::strerror(err),
         cu_result::out_of_memory);
  }
  if (vmas_after < vmas_before) return_vmas(vmas_before - vmas_after);
  for (const Update& u : updates) {
    bytes_accessible_ += (u.merged.second - u.merged.first) - u.mapping->accessible_bytes();
    u.mapping->access.set_one(u.merged);
  }
  for (auto& [mapping, updated] : copies) {
    bytes_accessible_ += updated.accessible_bytes() - mapping->accessible_bytes();
    *mapping = std::move(updated);
  }
  if (checked_) checked_reguard(ptr, size);  // freed pages in it stay guarded
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

}  // namespace vmalloc
