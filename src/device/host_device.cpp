// HostDevice: construction and teardown, and the books as a whole (the state snapshot, the
// error helper). Each other concern has its own file: host_device_physical.cpp (cuMemCreate,
// cuMemRelease), host_device_address_space.cpp (reservations), host_device_mappings.cpp (map,
// unmap, access), host_device_pinned.cpp (pinned host memory), host_device_vmas.cpp (the
// process's kernel VMA budget), host_device_streams.cpp (streams and events) and
// host_device_copies.cpp (copies). The records they share are in detail/host_device_books.hpp.
#include "vmalloc/device/host_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/host_device_books.hpp"
#include "vmalloc/device/detail/memfd_arena.hpp"
#include "vmalloc/device/detail/stream_set.hpp"

namespace vmalloc {

using detail::human_bytes;
using detail::is_pow2;

namespace {

// Unbacked reservations get addresses from here: far from anything the process maps.
constexpr device_ptr fake_address_base = 0x200000000000ULL;

}  // namespace

bool HostDeviceState::operator==(const HostDeviceState& o) const noexcept {
  return physical_allocations == o.physical_allocations &&
         released_still_mapped == o.released_still_mapped && reservations == o.reservations &&
         mappings == o.mappings && bytes_created == o.bytes_created &&
         bytes_reserved == o.bytes_reserved && bytes_mapped == o.bytes_mapped &&
         bytes_accessible == o.bytes_accessible && host_allocations == o.host_allocations &&
         host_bytes == o.host_bytes && streams == o.streams && events == o.events &&
         vmas == o.vmas && live_allocations == o.live_allocations &&
         bytes_guarded == o.bytes_guarded && unguarded_frees == o.unguarded_frees &&
         guard_runs == o.guard_runs && guard_runs_cap == o.guard_runs_cap &&
         guards_recycled == o.guards_recycled;
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
      checked_guard_runs_(options.checked_guard_runs),
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
  if (options.checked && backed_) start_checking();
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
  if (checked_) {
    s.live_allocations = checked_->live.size();
    s.bytes_guarded = checked_->bytes_guarded;
    s.unguarded_frees = checked_->unguarded_frees;
    s.guard_runs = checked_->guarded.size();
    s.guard_runs_cap = guard_runs_cap();
    s.guards_recycled = checked_->guards_recycled;
  }
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

}  // namespace vmalloc
