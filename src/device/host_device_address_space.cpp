// HostDevice: reservations of address space (cuMemAddressReserve, cuMemAddressFree):
// PROT_NONE anonymous ranges when backed, addresses from a counter when not.
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/host_device_books.hpp"

namespace vmalloc {

using detail::address_range;
using detail::hex;
using detail::human_bytes;
using detail::is_pow2;

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
         "the reservation " + address_range(ptr, size) + " still has a mapping at " +
             hex(m->first) + ": unmap it first",
         cu_result::invalid_value);
  if (checked_) checked_forget(ptr, size, /*reservation=*/true);
  if (backed_) {
    ::munmap(reinterpret_cast<void*>(ptr), size);
    return_vmas(1);
  }
  bytes_reserved_ -= size;
  reservations_.erase(it);
}

}  // namespace vmalloc
