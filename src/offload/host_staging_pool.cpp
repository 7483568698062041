#include "vmalloc/offload/host_staging_pool.hpp"

#include <algorithm>

#include "vmalloc/base/detail/format.hpp"

namespace vmalloc {

namespace {
constexpr std::size_t min_class = std::size_t{4} << 10;
constexpr std::size_t large_class = std::size_t{2} << 20;
}  // namespace

HostStagingPool::HostStagingPool(std::shared_ptr<Device> device, std::size_t capacity)
    : device_(std::move(device)), capacity_(capacity) {
  if (!device_) throw InvalidArgument("HostStagingPool: device is null");
  stats_.capacity_bytes = capacity;
}

HostStagingPool::~HostStagingPool() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached_locked();
  for (auto& e : in_use_) {
    try {
      device_->host_free(e.first);
    } catch (...) {
    }
  }
}

std::size_t HostStagingPool::size_class(std::size_t nbytes) noexcept {
  if (nbytes <= min_class) return min_class;
  if (nbytes <= large_class) {
    std::size_t c = min_class;
    while (c < nbytes) c <<= 1;
    return c;
  }
  return (nbytes + large_class - 1) / large_class * large_class;
}

std::multimap<std::size_t, void*>::const_iterator HostStagingPool::reusable(
    std::size_t c) const {
  // Best fit among blocks of at most twice the class: tensors of one model differ by a few
  // MiB from iteration to iteration (a swapped activation of 68 MiB where 70 MiB was freed),
  // and an exact-class cache then pins new pages every iteration (cuMemHostAlloc ran at
  // ~1.4 GB/s on an H200 host: 5.5 s of a 7 s GPT-2 step). Waste stays below half.
  auto hit = cached_.lower_bound(c);
  if (hit == cached_.end() || hit->first / 2 > c) return cached_.end();
  return hit;
}

void* HostStagingPool::allocate(std::size_t nbytes) {
  if (nbytes == 0 || nbytes > max_request_bytes)
    throw InvalidArgument("HostStagingPool.allocate: size " + std::to_string(nbytes) +
                          " must be positive and at most 2**56 bytes");
  const std::size_t c = size_class(nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_.reserve(in_use_.size() + 1);  // no bad_alloc after the block is taken
  auto hit = reusable(c);
  if (hit != cached_.end()) {
    void* p = hit->second;
    const std::size_t held = hit->first;  // the block keeps its own class
    cached_.erase(hit);
    in_use_.emplace(p, held);
    stats_.cached_bytes -= held;
    --stats_.blocks_cached;
    stats_.in_use_bytes += held;
    ++stats_.blocks_in_use;
    ++stats_.reuses;
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
    return p;
  }
  if (capacity_ != 0 && stats_.in_use_bytes + stats_.cached_bytes + c > capacity_) {
    if (stats_.in_use_bytes + c > capacity_) throw_over_capacity(nbytes);
    release_cached_locked();  // cached blocks of other classes make room
    if (stats_.in_use_bytes + stats_.cached_bytes + c > capacity_) throw_over_capacity(nbytes);
  }
  void* p = device_->host_alloc(c);  // may throw: nothing changed
  in_use_.emplace(p, c);
  ++stats_.host_alloc_calls;
  stats_.in_use_bytes += c;
  ++stats_.blocks_in_use;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return p;
}

void HostStagingPool::throw_over_capacity(std::size_t nbytes) const {
  const std::size_t c = size_class(nbytes);
  throw HostOutOfMemory(
      "SwapManager: out of pinned host memory: a request of " + std::to_string(nbytes) +
          " bytes (class " + detail::human_bytes(c) + ") exceeds the host capacity of " +
          detail::human_bytes(capacity_) + " with " + detail::human_bytes(stats_.in_use_bytes) +
          " in use",
      nbytes,
      "host in use " + std::to_string(stats_.in_use_bytes) + " of " + std::to_string(capacity_) +
          " bytes");
}

void HostStagingPool::check_capacity(std::size_t nbytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capacity_ == 0 || nbytes == 0) return;
  const std::size_t c = size_class(nbytes);
  if (reusable(c) != cached_.end()) return;  // served from the cache
  if (stats_.in_use_bytes + c > capacity_) throw_over_capacity(nbytes);
}

void HostStagingPool::deallocate(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = in_use_.find(ptr);
  if (it == in_use_.end())
    throw InvalidArgument("HostStagingPool.deallocate: " + detail::hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                          " is not a block in use of this pool");
  const std::size_t c = it->second;
  cached_.emplace(c, ptr);  // may throw bad_alloc: then nothing changed
  in_use_.erase(it);
  stats_.in_use_bytes -= c;
  --stats_.blocks_in_use;
  stats_.cached_bytes += c;
  ++stats_.blocks_cached;
}

std::size_t HostStagingPool::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  return release_cached_locked();
}

std::size_t HostStagingPool::release_cached_locked() noexcept {
  std::size_t freed = 0;
  for (auto it = cached_.begin(); it != cached_.end();) {
    try {
      device_->host_free(it->second);
    } catch (...) {
      ++it;  // kept: retried by the next release and the destructor
      continue;
    }
    freed += it->first;
    stats_.cached_bytes -= it->first;
    --stats_.blocks_cached;
    ++stats_.host_free_calls;
    it = cached_.erase(it);
  }
  return freed;
}

HostStagingStats HostStagingPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace vmalloc
