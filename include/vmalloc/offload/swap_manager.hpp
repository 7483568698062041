// SwapManager: moves the contents of live allocations to pinned host memory and back, behind
// a stable pointer where the allocator allows it (docs/swap_manager.rst).
//
// A swap-out copies the allocation to a host staging block on a dedicated device-to-host
// stream, ordered after the work queued on the caller's stream (an event recorded there), and
// releases the device memory only once the copy has completed: chunk-owning VirtualAllocator
// allocations are unmapped in place (VirtualAllocator::unmap_backing: the address stays
// reserved, the pointer stays valid); every other allocation (small blocks that share a chunk,
// packed placement, the caching allocator, adaptors) is deallocated and later allocated again:
// it relocates, and swap_in returns its new pointer. A swap-in acquires device memory (map or
// allocate; on OutOfMemory it first waits for in-flight swap-outs, oldest first, and retries),
// then copies on a host-to-device stream ordered after the caller's stream. The host copy is
// freed only once the swap-in's copy has completed: no data is ever lost.
//
// Frees: the manager is itself an Allocator over its upstream (RMM's adaptor pattern), and
// it watches the upstream's frees (a FreeObserver). A free of a swapped-out or in-flight
// allocation, through the manager or straight through the upstream (a framework's free
// callback), drops the record and the host copy at once, waiting for a copy in flight; the
// device memory goes to whoever still holds it. discard() forgets one without a free.
//
// Thread-safe: one mutex, never held while the host waits for the device, nor while the
// manager calls its upstream's deallocate. Lock order: a manager's mutex may be taken with
// no lock or with its upstream's observers running (a free of another manager on the same
// upstream reaches this one's Watcher), so it is never held across a call that runs them:
// the upstream's deallocate. Two managers over one allocator deadlocked without that rule
// (each freed under its own mutex and waited in the other's Watcher). Memory a poll finds
// ready to release is queued (frees_) and freed once the mutex is released; until then it is
// still live in the upstream, but no allocation's: the record's old address still names it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/offload/host_staging_pool.hpp"

namespace vmalloc {

class VirtualAllocator;

enum class SwapState : std::uint8_t { resident, swapping_out, on_host, swapping_in };
// "resident", "swapping_out", "on_host", "swapping_in".
const char* swap_state_name(SwapState state) noexcept;

struct SwapManagerOptions {
  std::size_t host_capacity = 0;  // most bytes of pinned host memory held; 0 = no limit
};

struct SwapStats {
  std::size_t swap_outs = 0;            // swap-outs started (cancelled ones included)
  std::size_t bytes_swapped_out = 0;
  std::size_t swap_ins = 0;             // swap-ins started (copies queued)
  std::size_t bytes_swapped_in = 0;
  std::size_t cancelled_swap_outs = 0;  // swap_in of an allocation still swapping out
  std::size_t relocations = 0;          // swap-ins that returned a different pointer
  std::size_t relocating_swap_outs = 0; // swap-outs that deallocate instead of unmapping
  std::size_t oom_retries = 0;          // waits for an in-flight swap-out after OutOfMemory
  std::size_t swap_in_failures = 0;     // swap_in calls that finally raised OutOfMemory
  std::size_t host_waits = 0;           // host waits for a copy (wait, deallocate, OOM retry)
  double wait_seconds = 0.0;            // time spent in those waits
  std::size_t swapping_out = 0;         // allocations in each state now
  std::size_t on_host = 0;
  std::size_t swapping_in = 0;
  std::size_t events_created = 0;
  HostStagingStats host;                // the pinned staging pool
};

class SwapManager final : public Allocator {
 public:
  // Throws InvalidArgument for a null allocator or one that is not backed (no data to copy).
  explicit SwapManager(std::shared_ptr<Allocator> allocator,
                       const SwapManagerOptions& options = {});
  // Waits for the device, then frees every host block, event and stream. Host copies still
  // held are dropped: relocated allocations on host are lost, chunk-owning ones stay live
  // and unbacked in the allocator (deallocate them there).
  ~SwapManager() override;
  SwapManager(const SwapManager&) = delete;
  SwapManager& operator=(const SwapManager&) = delete;

  // RESIDENT -> SWAPPING_OUT. An allocation still swapping in is first waited for (host).
  // Returns the allocation's name while it is out: `ptr` itself when the swap keeps the
  // pointer; for a relocating swap, a host address (never a device address), because once
  // the memory is released the allocator may give `ptr` to another allocation. The old
  // pointer also names it while no live allocation has that address.
  device_ptr swap_out(device_ptr ptr, stream_t stream);
  // ON_HOST -> SWAPPING_IN (returns the pointer: the same unless it relocates), or
  // SWAPPING_OUT -> RESIDENT (a cancel: the memory is still mapped, nothing to copy back).
  device_ptr swap_in(device_ptr ptr, stream_t stream);
  // SWAPPING_IN: `stream` waits (device-side) for the copy. SWAPPING_OUT: the host waits for
  // the copy and the memory is released (ON_HOST). Otherwise nothing.
  void wait(device_ptr ptr, stream_t stream);
  // The state of `ptr` (a tracked pointer, or a live allocation of the allocator: resident).
  // Throws InvalidPointer otherwise.
  SwapState state(device_ptr ptr);
  // --- the Allocator interface: the upstream's, swapped allocations included ---
  // allocator()->allocate (names of relocated allocations on host are host addresses, never
  // device ones, so any address it returns is unambiguous).
  device_ptr allocate(std::size_t nbytes, stream_t stream) override;
  // Frees an allocation in any state (waiting for a copy in flight), dropping its host copy;
  // `ptr` is its pointer or its name while out (the key swap_out returned). A resident
  // untracked one goes to the upstream. nbytes: the size asked for, or unknown_size.
  void deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) override;
  std::size_t release_cached() override { return allocator_->release_cached(); }
  Stats stats() const override { return allocator_->stats(); }
  void reset_peak_stats() override { allocator_->reset_peak_stats(); }
  // A tracked allocation's size (any state), else the upstream's answer.
  std::size_t allocation_size(device_ptr ptr) const override;
  // The upstream's, plus relocated allocations on host under their keys.
  std::vector<std::pair<device_ptr, std::size_t>> live_allocations() const override;
  std::string name() const override { return "swap"; }
  const std::shared_ptr<Device>& device() const override { return device_; }

  // Forgets the allocation named `ptr` (its pointer or key): its record and host copy go
  // (waiting for a copy in flight), the device memory stays with its owner: the allocation
  // itself is not freed (its owner frees it, or has: a free through the upstream already
  // forgot it). Device memory only the manager holds (a relocating swap-in rolled back) is
  // freed. Returns false, changing nothing, for a pointer the manager does not track.
  bool discard(device_ptr ptr);
  // Releases completed swap-outs and frees host copies of completed swap-ins, without
  // blocking. Returns how many allocations changed state. Also done at the start of every
  // call (errors then deferred to the next explicit poll or wait).
  std::size_t poll();
  // Swaps out every resident live allocation (swap-ins in flight are waited for first).
  // Strong guarantee: on error those started are cancelled. Returns how many started.
  // Appends (pointer, key) pairs to `keys` when given (the key as swap_out returns it).
  std::size_t swap_out_all(stream_t stream,
                           std::vector<std::pair<device_ptr, device_ptr>>* keys = nullptr);
  // Swaps in every tracked allocation, oldest swap-out first, appending (key, new pointer)
  // pairs to `moved` as it goes (the key as swap_out returned it). Stops at the first error (rethrown); those swapped in before
  // stay swapping in, and `moved` says which (their new pointers). Returns how many.
  std::size_t swap_in_all(stream_t stream, std::vector<std::pair<device_ptr, device_ptr>>& moved);

  SwapStats swap_stats() const;
  // Frees the staging pool's cached host blocks; the bytes freed.
  std::size_t release_cached_host();
  // True if swapping `ptr` (a live allocation) relocates it.
  bool relocates(device_ptr ptr) const;
  // The pinned staging pool (thread-safe on its own): other streams of host data to the
  // device (vmalloc.offload.PageStream) stage through it, so their pinned bytes count
  // against host_capacity and show in swap_stats().host.
  HostStagingPool& staging() noexcept { return host_; }
  stream_t d2h_stream() const noexcept { return d2h_.handle; }
  stream_t h2d_stream() const noexcept { return h2d_.handle; }
  const std::shared_ptr<Allocator>& allocator() const noexcept { return allocator_; }

 private:
  struct Record {
    std::size_t nbytes = 0;
    SwapState state = SwapState::resident;
    bool relocating = false;
    bool device_held = false;  // device memory held (not yet released / already acquired)
    device_ptr device_addr = 0;  // where, when held
    bool busy = false;         // a call works on it with the mutex released
    // Its memory is being freed upstream with the mutex released: from the moment the
    // upstream has freed it another thread may be given that address, and its free must not
    // find this record (find skips it).
    bool releasing = false;
    void* host = nullptr;      // staging block holding (or receiving) the data
    event_t done = 0;          // completion event of the copy in flight, 0 if none
    stream_t stream = 0;       // the caller's stream of the last swap
    std::uint64_t seq = 0;     // swap-out order (oldest first for OOM waits)
    device_ptr key = 0;        // its key in records_ (the pointer, or a host address)
    device_ptr old_addr = 0;   // relocating: the device address it had, an alias_ entry
  };
  class Watcher;  // the FreeObserver on the upstream (swap_free.cpp)
  struct UpstreamFree {  // a release decided under the mutex, made once it is released
    device_ptr ptr;
    std::size_t nbytes;
    stream_t stream;
    bool flushing = false;  // a flush_frees is freeing it now (the mutex released)
  };
  // Every public call that polls makes the queued frees as it returns, also when it throws.
  class FlushOnExit {
   public:
    FlushOnExit(SwapManager& owner, std::unique_lock<std::mutex>& lock)
        : owner_(owner), lock_(lock) {}
    ~FlushOnExit() {
      try {
        owner_.flush_frees(lock_, false);
      } catch (...) {
      }
    }
    FlushOnExit(const FlushOnExit&) = delete;
    FlushOnExit& operator=(const FlushOnExit&) = delete;

   private:
    SwapManager& owner_;
    std::unique_lock<std::mutex>& lock_;
  };
  struct Zombie {  // a cancelled swap-out's host block, freed once its copy completes
    void* host;
    event_t done;
  };
  // Owned streams and pooled events, destroyed with the manager (errors swallowed).
  struct OwnedStream {
    Device* device = nullptr;
    stream_t handle = 0;
    ~OwnedStream();
  };
  class EventPool {
   public:
    explicit EventPool(Device& device) : device_(device) {}
    ~EventPool();
    event_t acquire();
    void release(event_t event) noexcept;
    std::size_t created() const noexcept { return all_.size(); }

   private:
    Device& device_;
    std::vector<event_t> all_;
    std::vector<event_t> free_;
  };

  // With mutex_ held.
  // The record `ptr` names: its key, or the old device address of a relocating one while
  // that memory is still held, or after while no live allocation has that address.
  Record* find(device_ptr ptr);
  void erase_record(Record& r) noexcept;
  void check_not_busy(device_ptr ptr, const Record& r, const char* operation) const;
  [[noreturn]] void throw_state(device_ptr ptr, SwapState state, const char* operation,
                                const char* why) const;
  device_ptr swap_out_locked(device_ptr ptr, stream_t stream);
  device_ptr swap_in_locked(device_ptr ptr, stream_t stream, std::unique_lock<std::mutex>& lock);
  void release_out(device_ptr ptr, Record& r);
  void cancel_out(device_ptr ptr, Record& r, bool count_cancel);
  std::size_t poll_locked(bool rethrow);
  // Unlocks, host-waits for `event`, relocks (also when it throws); counts the wait.
  void wait_unlocked(std::unique_lock<std::mutex>& lock, event_t event);
  // wait_unlocked for the copy in flight of `r` (its `done` event), `r` marked busy meanwhile.
  void wait_busy(std::unique_lock<std::mutex>& lock, Record& r);
  void wait_for_swap_ins(std::unique_lock<std::mutex>& lock);
  // Registers the Watcher on the upstream / removes it and waits for calls in progress.
  void watch();
  void unwatch() noexcept;
  // allocator_->deallocate, unobserved by this manager's own Watcher (no re-entry). Never
  // with mutex_ held (the lock order above).
  void upstream_deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream);
  // upstream_deallocate with the mutex released meanwhile (relocked, also when it throws);
  // the record the caller works on must be busy (free_busy marks it).
  void free_unlocked(std::unique_lock<std::mutex>& lock, device_ptr ptr, std::size_t nbytes,
                     stream_t stream);
  void free_busy(std::unique_lock<std::mutex>& lock, Record& r, device_ptr ptr,
                 stream_t stream);
  // Makes the queued frees (frees_) with the mutex released; returns locked. A failed free
  // stays queued for the next call (the memory is never dropped); `rethrow` raises its error.
  void flush_frees(std::unique_lock<std::mutex>& lock, bool rethrow);
  // The record of `ptr` with no copy in flight (waited for, the mutex released meanwhile),
  // or nullptr if untracked. Throws for a record another thread works on.
  Record* settled(std::unique_lock<std::mutex>& lock, device_ptr ptr, const char* operation);
  // Drops the record and its host copy; the device memory is left to the caller.
  void drop(Record& r) noexcept;
  // The Watcher's body: the upstream is about to free `ptr` (see FreeObserver).
  bool before_upstream_free(device_ptr ptr, std::size_t nbytes, stream_t stream);

  const std::shared_ptr<Allocator> allocator_;
  std::shared_ptr<Watcher> watcher_;  // registered on allocator_ until the destructor
  const std::shared_ptr<Device> device_;
  VirtualAllocator* const chunks_;  // the allocator, when it can unmap in place
  mutable std::mutex mutex_;
  HostStagingPool host_;
  EventPool events_;
  OwnedStream d2h_;
  OwnedStream h2d_;
  std::map<device_ptr, Record> records_;  // every allocation not resident
  std::map<device_ptr, device_ptr> alias_;  // old device address -> key (relocating)
  std::vector<Zombie> zombies_;
  std::vector<UpstreamFree> frees_;  // released by a poll, not yet given to the upstream
  bool queued_free(device_ptr ptr) const noexcept;  // whether frees_ holds `ptr`
  std::uint64_t seq_ = 0;
  SwapStats stats_;
};

}  // namespace vmalloc
