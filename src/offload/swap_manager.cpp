#include "vmalloc/offload/swap_manager.hpp"

#include <algorithm>
#include <chrono>
#include <exception>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"
#include "vmalloc/device/host_device.hpp"
#include "vmalloc/alloc/virtual_allocator.hpp"

namespace vmalloc {

using detail::hex;

const char* swap_state_name(SwapState state) noexcept {
  switch (state) {
    case SwapState::resident: return "resident";
    case SwapState::swapping_out: return "swapping_out";
    case SwapState::on_host: return "on_host";
    case SwapState::swapping_in: return "swapping_in";
  }
  return "unknown";
}

namespace {

const std::shared_ptr<Allocator>& require_allocator(const std::shared_ptr<Allocator>& a) {
  if (!a) throw InvalidArgument("SwapManager: allocator is null");
  if (!a->device()) throw InvalidArgument("SwapManager: the allocator has no device");
  if (!a->device()->backed())
    throw InvalidArgument("SwapManager: device " + a->device()->name() +
                          " is not backed (accounting only): there is no data to swap");
  return a;
}

// A dedicated copy stream: non-blocking (no implicit ordering with the default stream: the
// manager orders with events), as CudaDevice creates every stream.
stream_t create_copy_stream(Device& device) {
  if (auto* host = dynamic_cast<HostDevice*>(&device)) return host->create_stream(true);
  return device.create_stream();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// owned resources

SwapManager::OwnedStream::~OwnedStream() {
  if (device != nullptr && handle != 0) {
    try {
      device->destroy_stream(handle);
    } catch (...) {
    }
  }
}

SwapManager::EventPool::~EventPool() {
  for (event_t e : all_) {
    try {
      device_.destroy_event(e);
    } catch (...) {
    }
  }
}

event_t SwapManager::EventPool::acquire() {
  if (!free_.empty()) {
    const event_t e = free_.back();
    free_.pop_back();
    return e;
  }
  all_.reserve(all_.size() + 1);
  free_.reserve(all_.size() + 1);  // release() never allocates
  const event_t e = device_.create_event();  // may throw: nothing changed
  all_.push_back(e);
  return e;
}

void SwapManager::EventPool::release(event_t event) noexcept {
  if (event != 0) free_.push_back(event);  // capacity reserved at acquire
}

// ---------------------------------------------------------------------------------------------
// construction

SwapManager::SwapManager(std::shared_ptr<Allocator> allocator, const SwapManagerOptions& options)
    : allocator_(require_allocator(allocator)),
      device_(allocator_->device()),
      chunks_(dynamic_cast<VirtualAllocator*>(allocator_.get())),
      host_(device_, options.host_capacity),
      events_(*device_) {
  d2h_.handle = create_copy_stream(*device_);
  d2h_.device = device_.get();
  h2d_.handle = create_copy_stream(*device_);  // on failure d2h_ is destroyed (RAII)
  h2d_.device = device_.get();
  watch();
}

SwapManager::~SwapManager() {
  unwatch();  // first, without the mutex: a free in progress in the Watcher takes it
  std::unique_lock<std::mutex> lock(mutex_);
  try {
    flush_frees(lock, false);  // memory released by a poll goes back to the upstream
  } catch (...) {
  }
  // Copies in flight read or write host blocks: they must finish before the blocks go.
  try {
    device_->synchronize();
  } catch (...) {
  }
  // Members free the rest: streams, events, then every host block (the pool's destructor).
}

// ---------------------------------------------------------------------------------------------
// helpers (mutex_ held)

SwapManager::Record* SwapManager::find(device_ptr ptr) {
  auto it = records_.find(ptr);
  if (it != records_.end()) return it->second.releasing ? nullptr : &it->second;
  auto a = alias_.find(ptr);
  if (a == alias_.end()) return nullptr;
  auto r = records_.find(a->second);
  if (r == records_.end() || r->second.releasing) return nullptr;
  if (r->second.device_held && r->second.device_addr == ptr) return &r->second;
  if (queued_free(ptr)) return &r->second;  // released, its free not yet made (flush_frees)
  // Released: the old address names the record unless the allocator gave it to a live
  // allocation meanwhile (which it then names).
  try {
    allocator_->allocation_size(ptr);
    return nullptr;
  } catch (const InvalidPointer&) {
    return &r->second;
  }
}

void SwapManager::erase_record(Record& r) noexcept {
  if (r.old_addr != 0) {
    auto a = alias_.find(r.old_addr);
    if (a != alias_.end() && a->second == r.key) alias_.erase(a);
  }
  records_.erase(r.key);
}

void SwapManager::throw_state(device_ptr ptr, SwapState state, const char* operation,
                              const char* why) const {
  throw InvalidArgument(std::string("SwapManager.") + operation + ": the allocation at " +
                        hex(ptr) + " is " + swap_state_name(state) + ": " + why);
}

void SwapManager::check_not_busy(device_ptr ptr, const Record& r, const char* operation) const {
  if (r.busy)
    throw_state(ptr, r.state, operation, "another thread is working on it (waiting for a copy)");
}

void SwapManager::wait_unlocked(std::unique_lock<std::mutex>& lock, event_t event) {
  const auto t0 = std::chrono::steady_clock::now();
  lock.unlock();
  try {
    device_->synchronize_event(event);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  stats_.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.host_waits;
}

void SwapManager::release_out(device_ptr ptr, Record& r) {
  // The copy has completed, and it was ordered after the caller's work before swap_out: no
  // work uses the memory any more, so no further host wait. A relocating one's memory goes
  // back to the upstream once the mutex is released (flush_frees: the lock order).
  if (r.relocating)
    frees_.push_back(UpstreamFree{r.device_addr, r.nbytes, r.stream});  // may throw: no change
  else
    chunks_->unmap_backing(ptr, r.stream, /*synchronize=*/false);
  r.device_held = false;
  r.device_addr = 0;
  r.state = SwapState::on_host;
  events_.release(r.done);
  r.done = 0;
}

void SwapManager::cancel_out(device_ptr ptr, Record& r, bool count_cancel) {
  // The memory is still mapped and unchanged: keep it. The host block is freed once the
  // copy's event has completed (poll, destructor).
  zombies_.reserve(zombies_.size() + 1);
  zombies_.push_back(Zombie{r.host, r.done});
  if (count_cancel) {
    ++stats_.cancelled_swap_outs;
  } else {  // a rollback: as if it never started
    --stats_.swap_outs;
    stats_.bytes_swapped_out -= r.nbytes;
    if (r.relocating) --stats_.relocating_swap_outs;
  }
  (void)ptr;
  erase_record(r);
}

std::size_t SwapManager::poll_locked(bool rethrow) {
  std::size_t changed = 0;
  std::exception_ptr error;
  for (std::size_t i = 0; i < zombies_.size();) {
    bool done = true;
    try {
      done = zombies_[i].done == 0 || device_->query_event(zombies_[i].done);
    } catch (...) {
      done = false;
      if (!error) error = std::current_exception();
    }
    if (!done) {
      ++i;
      continue;
    }
    try {
      host_.deallocate(zombies_[i].host);
    } catch (...) {
    }
    events_.release(zombies_[i].done);
    zombies_[i] = zombies_.back();
    zombies_.pop_back();
  }
  for (auto it = records_.begin(); it != records_.end();) {
    Record& r = it->second;
    const device_ptr ptr = it->first;
    ++it;  // `r` may be erased below
    if (r.busy || r.done == 0) continue;
    try {
      if (!device_->query_event(r.done)) continue;
      if (r.state == SwapState::swapping_out) {
        release_out(ptr, r);
        ++changed;
      } else if (r.state == SwapState::swapping_in) {
        // The copy to the device is done: only now may the host copy go.
        host_.deallocate(r.host);
        events_.release(r.done);
        erase_record(r);
        ++changed;
      }
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (rethrow && error) std::rethrow_exception(error);
  return changed;
}

void SwapManager::wait_busy(std::unique_lock<std::mutex>& lock, Record& r) {
  // Marked busy while the mutex is released, so that other calls leave the record alone.
  r.busy = true;
  try {
    wait_unlocked(lock, r.done);
  } catch (...) {
    r.busy = false;
    throw;
  }
  r.busy = false;
}

void SwapManager::wait_for_swap_ins(std::unique_lock<std::mutex>& lock) {
  std::vector<event_t> pending;
  for (auto& e : records_)
    if (e.second.state == SwapState::swapping_in && !e.second.busy && e.second.done != 0)
      pending.push_back(e.second.done);
  for (event_t ev : pending) wait_unlocked(lock, ev);
  if (!pending.empty()) poll_locked(true);
}

// ---------------------------------------------------------------------------------------------
// swap out

device_ptr SwapManager::swap_out(device_ptr ptr, stream_t stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  if (Record* r = find(ptr)) {
    check_not_busy(ptr, *r, "swap_out");
    if (r->state != SwapState::swapping_in)
      throw_state(ptr, r->state, "swap_out", "only a resident allocation can be swapped out");
    // Still swapping in: its copy must land before the data can go out again.
    wait_busy(lock, *r);
    poll_locked(false);
    if (Record* still = find(ptr))
      throw_state(ptr, still->state, "swap_out", "its swap-in could not be completed");
  }
  return swap_out_locked(ptr, stream);
}

device_ptr SwapManager::swap_out_locked(device_ptr ptr, stream_t stream) {
  const std::size_t nbytes = allocator_->allocation_size(ptr);  // InvalidPointer if not live
  const bool relocating = chunks_ == nullptr || !chunks_->owns_chunks(ptr);
  if (!relocating && chunks_->is_unbacked(ptr))
    throw InvalidArgument("SwapManager.swap_out: the allocation at " + hex(ptr) +
                          " is unbacked but not swapped out by this manager");
  // Bookkeeping first (a bad_alloc changes nothing), then events and host memory.
  auto it = records_.emplace(ptr, Record{}).first;
  struct Undo {
    SwapManager* self;
    device_ptr ptr;
    void* host = nullptr;
    event_t order = 0, done = 0;
    bool armed = true;
    ~Undo() {
      if (!armed) return;
      if (host != nullptr) {
        try {
          self->host_.deallocate(host);
        } catch (...) {
        }
      }
      self->events_.release(order);
      self->events_.release(done);
      self->records_.erase(ptr);
    }
  } undo{this, ptr};
  host_.check_capacity(nbytes);  // HostOutOfMemory before any driver call
  undo.order = events_.acquire();
  undo.done = events_.acquire();
  // The copy runs after the work queued on the caller's stream (which produced the data).
  // Recorded first: an invalid stream fails before host memory is taken.
  device_->record_event(undo.order, stream);
  undo.host = host_.allocate(nbytes);
  device_->wait_event(d2h_.handle, undo.order);
  device_->copy_to_host(undo.host, ptr, nbytes, d2h_.handle);
  try {
    device_->record_event(undo.done, d2h_.handle);
  } catch (...) {
    // The copy is queued and writes the host block: it must finish before the block is
    // reused. If even that cannot be known, the block waits for the destructor.
    try {
      device_->synchronize_stream(d2h_.handle);
    } catch (...) {
      zombies_.push_back(Zombie{undo.host, 0});
      undo.host = nullptr;
    }
    throw;
  }
  undo.armed = false;
  events_.release(undo.order);  // the wait captured the event's work when it was queued
  Record& r = it->second;
  r.nbytes = nbytes;
  r.state = SwapState::swapping_out;
  r.relocating = relocating;
  r.device_held = true;
  r.device_addr = ptr;
  r.host = undo.host;
  r.done = undo.done;
  r.stream = stream;
  r.seq = ++seq_;
  r.key = ptr;
  ++stats_.swap_outs;
  stats_.bytes_swapped_out += nbytes;
  if (relocating) {
    ++stats_.relocating_swap_outs;
    // Known from now on by its host block's address: once its memory is released, the
    // allocator may hand `ptr` to another allocation. Moving the node allocates nothing;
    // the alias (old address -> key) is a convenience, skipped if it cannot be stored.
    const device_ptr key = reinterpret_cast<device_ptr>(r.host);
    auto node = records_.extract(ptr);
    node.key() = key;
    records_.insert(std::move(node));
    Record& moved = records_.at(key);
    moved.key = key;
    try {
      alias_[ptr] = key;
      moved.old_addr = ptr;
    } catch (...) {
    }
    return key;
  }
  return ptr;
}

// ---------------------------------------------------------------------------------------------
// swap in

device_ptr SwapManager::swap_in(device_ptr ptr, stream_t stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  return swap_in_locked(ptr, stream, lock);
}

device_ptr SwapManager::swap_in_locked(device_ptr ptr, stream_t stream,
                                       std::unique_lock<std::mutex>& lock) {
  Record* r = find(ptr);
  if (r == nullptr) {
    allocator_->allocation_size(ptr);  // InvalidPointer for a pointer not live here
    throw_state(ptr, SwapState::resident, "swap_in", "only a swapped-out allocation can be swapped in");
  }
  check_not_busy(ptr, *r, "swap_in");
  if (r->state == SwapState::swapping_in)
    throw_state(ptr, r->state, "swap_in", "it is already swapping in (wait for it)");
  if (r->state == SwapState::swapping_out) {
    // A cancel: the memory is still mapped and unchanged, nothing to copy back. The copy
    // still reads it, though, and the caller may free or overwrite it as soon as this
    // returns: the host waits for the copy first (the mutex released).
    wait_busy(lock, *r);
    const device_ptr addr = r->device_addr;
    cancel_out(ptr, *r, true);
    return addr;
  }
  // ON_HOST: acquire device memory, waiting for in-flight swap-outs on OutOfMemory.
  r->busy = true;
  struct Unbusy {
    Record*& r;
    ~Unbusy() {
      if (r != nullptr) r->busy = false;
    }
  } unbusy{r};
  while (!r->device_held) {
    try {
      device_ptr p = r->key;
      if (r->relocating)
        p = allocator_->allocate(r->nbytes, stream);
      else
        chunks_->map_backing(r->key, stream);
      r->device_held = true;
      r->device_addr = p;
    } catch (const OutOfMemory&) {
      device_ptr oldest = 0;
      const Record* o = nullptr;
      for (auto& e : records_)
        if (e.second.state == SwapState::swapping_out && !e.second.busy && e.second.device_held &&
            (o == nullptr || e.second.seq < o->seq)) {
          o = &e.second;
          oldest = e.first;
        }
      if (o == nullptr) {
        ++stats_.swap_in_failures;
        throw;  // the data stays on host: a later swap_in may succeed
      }
      ++stats_.oom_retries;
      wait_unlocked(lock, o->done);
      poll_locked(false);
      if (Record* still = find(oldest)) {
        // Completed but not released by the poll (an error there): release it now, or fail.
        if (still->state == SwapState::swapping_out && !still->busy && still->device_held)
          release_out(oldest, *still);
      }
      flush_frees(lock, false);  // the released memory back to the upstream (r is busy)
    }
  }
  const device_ptr p = r->device_addr;
  event_t order = 0, done = 0;
  bool queued = false;
  try {
    order = events_.acquire();
    done = events_.acquire();
    // The copy overwrites memory the caller's stream may have used before: order after it.
    device_->record_event(order, stream);
    device_->wait_event(h2d_.handle, order);
    device_->copy_to_device(p, r->host, r->nbytes, h2d_.handle);
    queued = true;
    device_->record_event(done, h2d_.handle);
  } catch (...) {
    events_.release(order);
    events_.release(done);
    // Roll back to ON_HOST: the host copy is intact. The device memory goes back once no
    // copy writes it; if that fails, it stays held by the record (a later swap_in copies
    // into it, deallocate frees it).
    try {
      if (queued) device_->synchronize_stream(h2d_.handle);
      if (r->relocating)
        free_unlocked(lock, p, r->nbytes, stream);  // r is busy (Unbusy)
      else
        chunks_->unmap_backing(r->key, stream, /*synchronize=*/false);
      r->device_held = false;
      r->device_addr = 0;
    } catch (...) {
    }
    throw;
  }
  events_.release(order);
  r->state = SwapState::swapping_in;
  r->done = done;
  r->stream = stream;
  r->busy = false;
  ++stats_.swap_ins;
  stats_.bytes_swapped_in += r->nbytes;
  if (r->relocating) {
    // The record is now known by its new pointer (node moved, no allocation); the old
    // address no longer names it.
    if (p != r->old_addr) ++stats_.relocations;
    if (r->old_addr != 0) {
      auto a = alias_.find(r->old_addr);
      if (a != alias_.end() && a->second == r->key) alias_.erase(a);
      r->old_addr = 0;
    }
    auto node = records_.extract(r->key);
    node.key() = p;
    records_.insert(std::move(node));
    records_.at(p).key = p;
  }
  r = nullptr;  // nothing left for Unbusy
  return p;
}

// ---------------------------------------------------------------------------------------------
// wait, state, poll

void SwapManager::wait(device_ptr ptr, stream_t stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  Record* r = find(ptr);
  if (r == nullptr) {
    allocator_->allocation_size(ptr);  // resident, or InvalidPointer
    return;
  }
  check_not_busy(ptr, *r, "wait");
  if (r->state == SwapState::swapping_in) {
    device_->wait_event(stream, r->done);  // device-side: no host wait
    return;
  }
  if (r->state != SwapState::swapping_out) return;  // on host: nothing in flight
  wait_busy(lock, *r);
  if (r->state == SwapState::swapping_out) release_out(ptr, *r);
  flush_frees(lock, true);  // released: its memory is back with the upstream, or this throws
}

SwapState SwapManager::state(device_ptr ptr) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  if (const Record* r = find(ptr)) return r->state;
  allocator_->allocation_size(ptr);  // InvalidPointer for an unknown pointer
  return SwapState::resident;
}

std::size_t SwapManager::poll() {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  const std::size_t changed = poll_locked(true);
  flush_frees(lock, true);
  return changed;
}

// ---------------------------------------------------------------------------------------------
// everything at once

std::size_t SwapManager::swap_out_all(stream_t stream,
                                      std::vector<std::pair<device_ptr, device_ptr>>* keys) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  wait_for_swap_ins(lock);
  auto live = allocator_->live_allocations();
  std::sort(live.begin(), live.end());
  std::vector<device_ptr> started;  // keys
  started.reserve(live.size());
  std::vector<std::pair<device_ptr, device_ptr>> pairs;
  pairs.reserve(live.size());
  try {
    for (const auto& e : live) {
      if (find(e.first) != nullptr || queued_free(e.first)) continue;  // out, or released
      const device_ptr key = swap_out_locked(e.first, stream);
      started.push_back(key);
      pairs.emplace_back(e.first, key);
    }
    if (keys != nullptr) keys->insert(keys->end(), pairs.begin(), pairs.end());
  } catch (...) {
    // Roll back: the copies started read memory the caller keeps using; wait for them (an
    // error path, so the host waits under the mutex). Their host blocks go once their events
    // complete.
    try {
      if (!started.empty()) device_->synchronize_stream(d2h_.handle);
    } catch (...) {
    }
    for (device_ptr p : started)
      if (Record* r = find(p)) cancel_out(p, *r, false);
    throw;
  }
  return started.size();
}

std::size_t SwapManager::swap_in_all(stream_t stream,
                                     std::vector<std::pair<device_ptr, device_ptr>>& moved) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  std::vector<std::pair<std::uint64_t, device_ptr>> order;
  for (auto& e : records_)
    if (!e.second.busy && (e.second.state == SwapState::on_host ||
                           e.second.state == SwapState::swapping_out))
      order.emplace_back(e.second.seq, e.first);
  std::sort(order.begin(), order.end());
  moved.reserve(moved.size() + order.size());
  std::size_t n = 0;
  for (const auto& o : order) {
    const Record* r = find(o.second);
    if (r == nullptr || r->busy ||
        (r->state != SwapState::on_host && r->state != SwapState::swapping_out))
      continue;  // changed by another thread while this one waited
    // Keyed by the name swap_out gave it: old addresses may have been reused meanwhile.
    moved.emplace_back(o.second, swap_in_locked(o.second, stream, lock));
    ++n;
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// introspection

SwapStats SwapManager::swap_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  SwapStats s = stats_;
  s.swapping_out = s.on_host = s.swapping_in = 0;
  for (const auto& e : records_) {
    switch (e.second.state) {
      case SwapState::swapping_out: ++s.swapping_out; break;
      case SwapState::on_host: ++s.on_host; break;
      case SwapState::swapping_in: ++s.swapping_in; break;
      default: break;
    }
  }
  s.events_created = events_.created();
  s.host = host_.stats();
  return s;
}

std::size_t SwapManager::release_cached_host() {
  std::lock_guard<std::mutex> lock(mutex_);
  return host_.release_cached();
}

bool SwapManager::relocates(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (const Record* r = const_cast<SwapManager*>(this)->find(ptr)) return r->relocating;
  allocator_->allocation_size(ptr);
  return chunks_ == nullptr || !chunks_->owns_chunks(ptr);
}

}  // namespace vmalloc
