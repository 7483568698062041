// HostDevice: a GPU emulated on host memory, enforcing the CUDA driver's virtual memory rules.
//
// Physical allocations are regions of one memfd; reservations are PROT_NONE address ranges;
// a mapping is the memfd region mmap'ed (MAP_SHARED) into a reservation, inaccessible until
// set_access. So remapping is real (the same bytes appear at the new address) and touching
// memory before set_access is refused. Every rule of ../shared/reference/cuda-vmm.md marked
// "(enforce)" is checked; a violation throws DeviceError naming the rule, the entry point and
// the CUresult code, and changes nothing. An unbacked HostDevice keeps the same books without
// any memory, so traces far larger than the machine replay on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc {

namespace detail {
class MemfdArena;
class StreamSet;
}  // namespace detail

struct HostDeviceOptions {
  std::size_t capacity = 0;                      // physical bytes; 0 = unlimited
  std::size_t granularity = std::size_t{2} << 20;  // a power-of-two multiple of the page size
  bool backed = true;                            // false: accounting only, no memory
  int ordinal = 0;                               // the "N" of "host:N"
  // Checked mode (host_device_checked.cpp): host pages holding no byte of a live allocation
  // of an allocator on this device, once freed or relocated, are PROT_NONE, so a stray touch
  // raises SIGSEGV (reported with the freed allocation) and a copy there is refused. Ignored
  // when not backed.
  bool checked = false;
  // Checked mode: the most guarded runs at a time (each costs up to two kernel mappings);
  // past it the oldest is opened again. 0: vma_limit() / 8 (a quarter of the budget).
  std::size_t checked_guard_runs = 0;
};

// A consistent snapshot of the device's books, for tests ("a rejected call changed nothing")
// and for the state line of OutOfMemory.
struct HostDeviceState {
  std::size_t physical_allocations = 0;   // created and not yet freed
  std::size_t released_still_mapped = 0;  // released, freed when their last mapping goes
  std::size_t reservations = 0;
  std::size_t mappings = 0;
  std::size_t bytes_created = 0;          // == physical_bytes_in_use()
  std::size_t bytes_reserved = 0;
  std::size_t bytes_mapped = 0;
  std::size_t bytes_accessible = 0;       // mapped bytes with read-write access set
  std::size_t host_allocations = 0;       // pinned host memory (host_alloc)
  std::size_t host_bytes = 0;
  std::size_t streams = 0;                // created streams, the default stream not counted
  std::size_t events = 0;
  std::size_t vmas = 0;                   // upper bound of kernel VMAs held (backed only)
  std::size_t live_allocations = 0;       // checked mode: allocations allocators said are live
  std::size_t bytes_guarded = 0;          // checked mode: freed pages made inaccessible
  std::size_t unguarded_frees = 0;        // checked mode: frees left open (VMA budget spent)
  std::size_t guard_runs = 0;             // checked mode: guarded page runs now
  std::size_t guard_runs_cap = 0;         // checked mode: the most runs at a time
  std::size_t guards_recycled = 0;        // checked mode: runs opened to stay under the cap

  bool operator==(const HostDeviceState& o) const noexcept;
  bool operator!=(const HostDeviceState& o) const noexcept { return !(*this == o); }
  // "host:0: 3 allocations (6.00MiB of 16.00MiB capacity), 1 reservation (8.00MiB), ..."
  std::string summary() const;
};

class HostDevice : public Device {
 public:
  // Throws InvalidArgument for a granularity that is not a power-of-two multiple of the host
  // page size, or a negative ordinal.
  explicit HostDevice(const HostDeviceOptions& options = {});
  ~HostDevice() override;

  std::string name() const override;
  int ordinal() const override { return ordinal_; }
  std::size_t granularity() const override { return granularity_; }
  std::size_t capacity() const override { return capacity_; }
  std::size_t physical_bytes_in_use() const override;
  bool backed() const override { return backed_; }
  bool checked() const noexcept { return checked_ != nullptr; }

  physical_handle create(std::size_t size) override;
  void release(physical_handle handle) override;
  device_ptr reserve(std::size_t size, std::size_t alignment) override;
  void free_address(device_ptr ptr, std::size_t size) override;
  void map(device_ptr ptr, std::size_t size, physical_handle handle) override;
  void map_chunks(device_ptr base, std::size_t size, const physical_handle* handles,
                  std::size_t n, std::size_t& mapped) override;
  void unmap(device_ptr ptr, std::size_t size) override;
  void set_access(device_ptr ptr, std::size_t size) override;

  void* host_alloc(std::size_t size) override;
  void host_free(void* ptr) override;

  stream_t create_stream() override;  // blocking: ordered with the default stream
  // `non_blocking`: like CU_STREAM_NON_BLOCKING, no implicit ordering with stream 0.
  stream_t create_stream(bool non_blocking);
  void destroy_stream(stream_t stream) override;
  void check_stream_alive(stream_t stream, const char* caller) const override;
  event_t create_event() override;
  void destroy_event(event_t event) override;
  void record_event(event_t event, stream_t stream) override;
  bool query_event(event_t event) override;
  void synchronize_event(event_t event) override;
  void wait_event(stream_t stream, event_t event) override;
  void synchronize_stream(stream_t stream) override;
  void synchronize() override;

  void copy_to_device(device_ptr dst, const void* src, std::size_t nbytes,
                      stream_t stream) override;
  void copy_to_host(void* dst, device_ptr src, std::size_t nbytes, stream_t stream) override;
  void copy_device(device_ptr dst, device_ptr src, std::size_t nbytes, stream_t stream) override;

  // cuLaunchHostFunc: runs `fn` on the stream's worker, in order with the stream's work.
  // An exception from `fn` becomes the fault reported by the next synchronization.
  // Not counted (no DriverCall): it moves no memory.
  void launch_host_func(stream_t stream, std::function<void()> fn);
  // A testing aid: blocks `stream` (like a kernel that runs until told to stop) so queued
  // work can be observed before it runs. Returns an id for release_hold. Destroying the
  // device releases every hold.
  std::uint64_t hold_stream(stream_t stream);
  void release_hold(std::uint64_t hold);

  HostDeviceState state() const;
  // Kernel VMAs this device may create before it refuses (vm.max_map_count minus headroom,
  // shared by every HostDevice of the process). Settable for tests of the refusal.
  static std::size_t vma_limit() noexcept;
  static void set_vma_limit(std::size_t limit) noexcept;
  // Kernel VMAs held now by all HostDevices of the process (an upper bound).
  static std::size_t process_vmas() noexcept;

 protected:
  void on_live(device_ptr ptr, std::size_t nbytes) noexcept override;
  void on_freed(device_ptr ptr) noexcept override;

 private:
  struct Physical;
  struct Reservation;
  struct Mapping;
  struct HostBlock;

  // Bookkeeping helpers; the caller holds mutex_.
  [[noreturn]] void fail(DriverCall call, const std::string& rule, int code) const;
  // map()'s work under mutex_ (held unique); `next` is the first mapping at or after ptr
  // (mappings_.lower_bound(ptr)); `inside`: [ptr, ptr+size) is known to lie in one
  // reservation. Returns the new mapping's node: `next` stays its successor, and so the lower
  // bound of the chunk right after it.
  std::map<device_ptr, Mapping>::iterator map_locked(
      device_ptr ptr, std::size_t size, physical_handle handle,
      std::map<device_ptr, Mapping>::iterator next, bool inside);
  Reservation* reservation_containing(device_ptr ptr, std::size_t size);
  // The mappings exactly covering [ptr, ptr+size) contiguously inside one reservation, or
  // an empty result with `why` set.
  bool covering_mappings(device_ptr ptr, std::size_t size, bool whole_only,
                         std::map<device_ptr, Mapping>::iterator* first, std::string* why);
  // "" if every byte of [ptr, ptr+n) is mapped with access set, else the reason.
  std::string check_accessible(device_ptr ptr, std::size_t n) const;
  void free_physical(std::unordered_map<physical_handle, Physical>::iterator it) noexcept;
  void reserve_vmas(std::size_t more, DriverCall call);
  void return_vmas(std::size_t fewer) noexcept;
  HostDeviceState state_locked() const;
  std::string state_line_locked() const;

  // Copies, executed in order on a stream. They validate the device range under the lock
  // (shared, so copies run in parallel with each other but never with a change of the map).
  struct CopyJob;
  void enqueue_copy(const CopyJob& job, stream_t stream, bool wait);
  void execute_copy(const CopyJob& job);
  bool host_range_pinned(std::uintptr_t ptr, std::size_t n) const;

  // Checked mode (host_device_checked.cpp); the caller holds mutex_, unique unless const.
  struct Checked;
  void start_checking();  // the constructor's, with options.checked on a backed device
  // After unmap of [ptr, ptr+size): its guards go (the pages are plain reservation again);
  // the freed records stay, so a chunk mapped there again is guarded where bytes were freed.
  // Before free_address (`reservation`): its freed and live records go too.
  void checked_forget(device_ptr ptr, std::size_t size, bool reservation) noexcept;
  // After set_access opened [ptr, ptr+size): guarded and freed pages in it are closed again.
  void checked_reguard(device_ptr ptr, std::size_t size) noexcept;
  // Makes PROT_NONE the accessible pages of [lo, hi) holding a freed byte and no live one.
  void guard_freed(device_ptr lo, device_ptr hi) noexcept;
  // "" unless [ptr, ptr+n) holds a freed byte: then why a copy is refused.
  std::string checked_refusal(device_ptr ptr, std::size_t n) const;
  bool checked_guarded(device_ptr ptr, std::size_t n) const noexcept;
  // A copy's piece through the memfd, so stream-ordered work queued before a free still runs.
  void copy_through_memfd(const CopyJob& job, std::size_t off, std::size_t n) const;
  void memfd_io(device_ptr ptr, unsigned char* buf, std::size_t n, bool write) const;
  void reserve_vmas_unchecked(std::size_t more) noexcept;
  // The guard budget (host_device_guards.cpp).
  std::size_t guard_runs_cap() const noexcept;
  // Opens the oldest guarded run (its VMAs go back); false when none is left.
  bool recycle_oldest_guard() noexcept;
  // Queues a guarded piece [lo, hi) for recycling.
  void note_guard(device_ptr lo, device_ptr hi) noexcept;

  const std::size_t capacity_;
  const std::size_t granularity_;
  const std::size_t page_size_;
  const bool backed_;
  const int ordinal_;
  const std::size_t checked_guard_runs_;

  mutable std::shared_mutex mutex_;  // the books below and the address map they describe
  std::unique_ptr<detail::MemfdArena> arena_;
  // By handle, never walked in order: hashed, since every map and unmap looks its handle up
  // (an ordered map's walk down thousands of nodes showed in every simulated plan).
  std::unordered_map<physical_handle, Physical> physical_;
  std::map<device_ptr, Reservation> reservations_;  // by base address
  std::map<device_ptr, Mapping> mappings_;          // by address
  // Nodes of mappings unmapped, reused by the next maps (at most kSpareMappings): mapping and
  // unmapping a chunk then allocates nothing (a simulated plan maps ~10^5 chunks).
  static constexpr std::size_t kSpareMappings = 1 << 16;
  std::vector<std::map<device_ptr, Mapping>::node_type> spare_mappings_;
  std::map<std::uintptr_t, HostBlock> host_blocks_;  // by base address
  physical_handle next_handle_ = 1;
  device_ptr next_fake_address_;  // unbacked reservations
  std::size_t bytes_created_ = 0;
  std::size_t released_still_mapped_ = 0;
  std::size_t bytes_reserved_ = 0;
  std::size_t bytes_mapped_ = 0;
  std::size_t bytes_accessible_ = 0;
  std::size_t host_bytes_ = 0;
  std::size_t vmas_ = 0;

  std::unique_ptr<detail::StreamSet> streams_;
  std::unique_ptr<Checked> checked_;  // null unless checked
};

}  // namespace vmalloc
