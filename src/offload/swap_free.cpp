// The SwapManager's free path: frees through the manager (it is an Allocator over its
// upstream), frees straight through the upstream (its Watcher, a FreeObserver), and discard.
//
// Why both: a framework registers one allocator and every free of its memory goes there. If
// that is the manager, it sees every free and resolves names itself (a relocated allocation
// on host is known by its key; its old address is never passed on while another allocation
// may have it). If it is the upstream (a VirtualAllocator set as PyTorch's allocator before
// the manager existed), the Watcher is told of each free before the upstream makes it: a
// record left behind would leak the host copy, refuse the next allocation at that address
// and break swap_in_all.
#include <algorithm>
#include <exception>
#include <shared_mutex>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"
#include "vmalloc/offload/swap_manager.hpp"

namespace vmalloc {

using detail::hex;

namespace {
// The manager now calling its upstream's deallocate on this thread: its own Watcher lets
// that free through (the manager has settled the record; its mutex may be held).
thread_local const SwapManager* t_freeing = nullptr;
}  // namespace

class SwapManager::Watcher final : public FreeObserver {
 public:
  explicit Watcher(SwapManager* owner) : owner_(owner) {}

  bool before_free(device_ptr ptr, std::size_t nbytes, stream_t stream) override {
    if (t_freeing == owner_) return false;  // before locking: no recursive shared lock
    std::shared_lock<std::shared_mutex> lock(mutex_);
    if (!attached_) return false;
    return owner_->before_upstream_free(ptr, nbytes, stream);
  }
  // Waits for the calls in progress; later ones let every free through.
  void detach() noexcept {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    attached_ = false;
  }

 private:
  SwapManager* const owner_;
  std::shared_mutex mutex_;
  bool attached_ = true;
};

void SwapManager::watch() {
  watcher_ = std::make_shared<Watcher>(this);
  allocator_->add_free_observer(watcher_);
}

void SwapManager::unwatch() noexcept {
  if (!watcher_) return;
  allocator_->remove_free_observer(watcher_.get());
  watcher_->detach();
}

void SwapManager::upstream_deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  const SwapManager* outer = t_freeing;
  t_freeing = this;
  try {
    allocator_->deallocate(ptr, nbytes, stream);
  } catch (...) {
    t_freeing = outer;
    throw;
  }
  t_freeing = outer;
}

void SwapManager::free_unlocked(std::unique_lock<std::mutex>& lock, device_ptr ptr,
                                std::size_t nbytes, stream_t stream) {
  lock.unlock();
  try {
    upstream_deallocate(ptr, nbytes, stream);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
}

void SwapManager::free_busy(std::unique_lock<std::mutex>& lock, Record& r, device_ptr ptr,
                            stream_t stream) {
  r.busy = true;  // other calls leave it alone while the mutex is released; the node stays
  // ...and frees of that address by others pass it by: once the upstream has freed it, the
  // address may be another thread's allocation, whose free found this record and failed
  // "busy" (two managers, two threads: 2 runs in 32 of test_swap_two_managers).
  r.releasing = true;
  try {
    free_unlocked(lock, ptr, r.nbytes, stream);
  } catch (...) {
    r.busy = false;
    r.releasing = false;
    throw;
  }
  r.busy = false;  // stays releasing: the caller drops it next, with the mutex held
}

bool SwapManager::queued_free(device_ptr ptr) const noexcept {
  for (const UpstreamFree& f : frees_)
    if (f.ptr == ptr) return true;
  return false;
}

void SwapManager::flush_frees(std::unique_lock<std::mutex>& lock, bool rethrow) {
  if (!lock.owns_lock()) lock.lock();
  std::exception_ptr error;
  std::vector<device_ptr> failed;  // tried by this call: left for the next one
  // Entries stay in frees_ while they are freed (flushing), so that find() still knows the
  // memory as released; another thread's flush leaves them alone.
  for (;;) {
    auto it = std::find_if(frees_.begin(), frees_.end(),
                           [&](const UpstreamFree& f) {
                             return !f.flushing &&
                                    std::find(failed.begin(), failed.end(), f.ptr) == failed.end();
                           });
    if (it == frees_.end()) break;
    it->flushing = true;
    const UpstreamFree f = *it;
    bool freed = true;
    lock.unlock();
    try {
      upstream_deallocate(f.ptr, f.nbytes, f.stream);
    } catch (...) {
      freed = false;
      if (!error) error = std::current_exception();
    }
    lock.lock();
    it = std::find_if(frees_.begin(), frees_.end(),
                      [&](const UpstreamFree& g) { return g.ptr == f.ptr && g.flushing; });
    if (it == frees_.end()) continue;
    if (freed) {
      frees_.erase(it);
    } else {
      it->flushing = false;  // tried again by the next call
      try {
        failed.push_back(f.ptr);
      } catch (...) {
        break;
      }
    }
  }
  if (rethrow && error) std::rethrow_exception(error);
}

SwapManager::Record* SwapManager::settled(std::unique_lock<std::mutex>& lock, device_ptr ptr,
                                          const char* operation) {
  Record* r = find(ptr);
  if (r == nullptr) return nullptr;
  check_not_busy(ptr, *r, operation);
  // A copy in flight reads or writes its memory and host block: let it finish (busy meanwhile,
  // so other calls and polls leave the record alone; the node stays put).
  if (r->done != 0) wait_busy(lock, *r);
  return r;
}

void SwapManager::drop(Record& r) noexcept {
  try {
    host_.deallocate(r.host);
  } catch (...) {
  }
  events_.release(r.done);
  erase_record(r);
}

namespace {
void check_size(device_ptr ptr, std::size_t nbytes, std::size_t requested) {
  if (nbytes != unknown_size && nbytes != requested)
    throw InvalidArgument("SwapManager.deallocate: nbytes = " + std::to_string(nbytes) +
                          " for the allocation at " + hex(ptr) + " of " +
                          std::to_string(requested) + " bytes");
}
}  // namespace

device_ptr SwapManager::allocate(std::size_t nbytes, stream_t stream) {
  return allocator_->allocate(nbytes, stream);
}

void SwapManager::deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  if (observe_free(ptr, nbytes, stream)) return;  // a manager over this one took it
  if (ptr == 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  Record* r = settled(lock, ptr, "deallocate");
  if (r == nullptr) {
    // Resident: the upstream's own, freed with the mutex released, and seen by this
    // manager's Watcher too (a swap_out another thread started meanwhile is resolved there).
    lock.unlock();
    allocator_->deallocate(ptr, nbytes, stream);
    return;
  }
  check_size(ptr, nbytes, r->nbytes);
  if (r->device_held)
    free_busy(lock, *r, r->device_addr, stream);
  else if (!r->relocating)
    free_busy(lock, *r, r->key, stream);  // the unbacked range
  drop(*r);
}

bool SwapManager::before_upstream_free(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  // A relocated allocation's old address names it only while no live allocation has it
  // (find): a free of a live allocation there is that allocation's, passed through.
  Record* r = settled(lock, ptr, "deallocate");
  if (r == nullptr) return false;
  check_size(ptr, nbytes, r->nbytes);
  // The upstream frees `ptr` itself when it is the memory the record holds (a swap-out's or
  // swap-in's in flight), or the unbacked range of a chunk-owning allocation; memory held
  // elsewhere (a relocating swap-in rolled back) is freed here; on host there is none.
  bool taken = true;
  if (r->device_held && r->device_addr != ptr)
    free_busy(lock, *r, r->device_addr, stream);
  else if (r->device_held || !r->relocating)
    taken = false;
  drop(*r);
  return taken;
}

bool SwapManager::discard(device_ptr ptr) {
  std::unique_lock<std::mutex> lock(mutex_);
  FlushOnExit flush(*this, lock);
  poll_locked(false);
  Record* r = settled(lock, ptr, "discard");
  if (r == nullptr) return false;
  // In flight the held memory is the allocation itself (its owner's); on host a relocating
  // record holds memory only after a failed rollback, and nobody else knows of it.
  if (r->relocating && r->device_held && r->state == SwapState::on_host)
    free_busy(lock, *r, r->device_addr, r->stream);
  drop(*r);
  return true;
}

std::size_t SwapManager::allocation_size(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (const Record* r = const_cast<SwapManager*>(this)->find(ptr)) return r->nbytes;
  return allocator_->allocation_size(ptr);
}

std::vector<std::pair<device_ptr, std::size_t>> SwapManager::live_allocations() const {
  auto live = allocator_->live_allocations();
  std::lock_guard<std::mutex> lock(mutex_);
  // Memory released but not yet given back (flush_frees) is nobody's allocation.
  if (!frees_.empty())
    live.erase(std::remove_if(live.begin(), live.end(),
                              [&](const auto& e) { return queued_free(e.first); }),
               live.end());
  for (const auto& e : records_)
    if (e.second.relocating && !e.second.device_held) live.emplace_back(e.first, e.second.nbytes);
  return live;
}

}  // namespace vmalloc
