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
  poll_locked(false);
  Record* r = settled(lock, ptr, "deallocate");
  if (r == nullptr) {
    upstream_deallocate(ptr, nbytes, stream);  // resident: the upstream's own
    return;
  }
  check_size(ptr, nbytes, r->nbytes);
  if (r->device_held)
    upstream_deallocate(r->device_addr, r->nbytes, stream);
  else if (!r->relocating)
    upstream_deallocate(r->key, r->nbytes, stream);  // the unbacked range
  drop(*r);
}

bool SwapManager::before_upstream_free(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  std::unique_lock<std::mutex> lock(mutex_);
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
    upstream_deallocate(r->device_addr, r->nbytes, stream);
  else if (r->device_held || !r->relocating)
    taken = false;
  drop(*r);
  return taken;
}

bool SwapManager::discard(device_ptr ptr) {
  std::unique_lock<std::mutex> lock(mutex_);
  poll_locked(false);
  Record* r = settled(lock, ptr, "discard");
  if (r == nullptr) return false;
  // In flight the held memory is the allocation itself (its owner's); on host a relocating
  // record holds memory only after a failed rollback, and nobody else knows of it.
  if (r->relocating && r->device_held && r->state == SwapState::on_host)
    upstream_deallocate(r->device_addr, r->nbytes, r->stream);
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
  for (const auto& e : records_)
    if (e.second.relocating && !e.second.device_held) live.emplace_back(e.first, e.second.nbytes);
  return live;
}

}  // namespace vmalloc
