#include "vmalloc/chunks/physical_chunk_pool.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "vmalloc/base/errors.hpp"

namespace vmalloc {

namespace {
std::shared_ptr<Device> checked(std::shared_ptr<Device> device) {
  if (!device) throw InvalidArgument("PhysicalChunkPool: device is null");
  return device;
}
}  // namespace

PhysicalChunkPool::PhysicalChunkPool(std::shared_ptr<Device> device, std::size_t chunk_size,
                                     std::size_t budget)
    : device_(checked(std::move(device))), chunk_size_(chunk_size), budget_(budget) {
  const std::size_t g = device_->granularity();
  if (chunk_size == 0 || g == 0 || chunk_size % g != 0 || chunk_size > max_request_bytes)
    throw InvalidArgument("chunk_size " + std::to_string(chunk_size) +
                          " must be a positive multiple of the granularity of device " +
                          device_->name() + " (" + std::to_string(g) + " bytes)");
  if (budget != 0 && budget < chunk_size)
    throw InvalidArgument("budget " + std::to_string(budget) +
                          " bytes is smaller than one chunk (" + std::to_string(chunk_size) +
                          " bytes)");
}

PhysicalChunkPool::~PhysicalChunkPool() {
  std::lock_guard<std::mutex> lock(mutex_);
  auto release = [this](physical_handle h) {
    try {
      device_->release(h);
    } catch (...) {
      // Teardown never throws; the device reports its own inconsistencies.
    }
  };
  for (physical_handle h : cached_) release(h);
  for (physical_handle h : given_out_) release(h);
}

physical_handle PhysicalChunkPool::create_locked() {
  const std::size_t held = cached_.size() + given_out_.size();
  if (budget_ != 0 && (held + 1) * chunk_size_ > budget_)
    throw OutOfMemory("PhysicalChunkPool: budget of " + std::to_string(budget_) +
                          " bytes reached (" + std::to_string(held) + " chunks of " +
                          std::to_string(chunk_size_) + " bytes held)",
                      chunk_size_, "chunks_held=" + std::to_string(held));
  if (held >= max_pool_chunks)
    throw OutOfMemory("PhysicalChunkPool: " + std::to_string(held) +
                          " chunks held, the most one pool keeps books for",
                      chunk_size_, "chunks_held=" + std::to_string(held));
  const physical_handle h = device_->create(chunk_size_);  // throws OutOfMemory / DeviceError
  try {
    given_out_.insert(h);
  } catch (...) {
    device_->release(h);  // bookkeeping failed (bad_alloc): undo the create
    throw;
  }
  ++created_;
  peak_held_ = std::max(peak_held_, held + 1);
  return h;
}

physical_handle PhysicalChunkPool::acquire() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cached_.empty()) {
    const physical_handle h = cached_.back();
    given_out_.insert(h);  // may throw bad_alloc: then the chunk is still cached
    cached_.pop_back();
    return h;
  }
  return create_locked();
}

physical_handle PhysicalChunkPool::take_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (cached_.empty()) return 0;
  const physical_handle h = cached_.back();
  given_out_.insert(h);  // may throw bad_alloc: then the chunk is still cached
  cached_.pop_back();
  return h;
}

physical_handle PhysicalChunkPool::create() {
  std::lock_guard<std::mutex> lock(mutex_);
  return create_locked();
}

void PhysicalChunkPool::give_back(physical_handle chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = given_out_.find(chunk);
  if (it == given_out_.end())
    throw InvalidArgument("PhysicalChunkPool: handle " + std::to_string(chunk) +
                          " is not a chunk of this pool in use (unknown or already given back)");
  cached_.reserve(cached_.size() + 1);
  given_out_.erase(it);
  cached_.push_back(chunk);
}

void PhysicalChunkPool::give_back(const std::vector<physical_handle>& chunks) {
  std::lock_guard<std::mutex> lock(mutex_);
  cached_.reserve(cached_.size() + chunks.size());
  for (physical_handle chunk : chunks) {
    auto it = given_out_.find(chunk);
    if (it == given_out_.end())
      throw InvalidArgument("PhysicalChunkPool: handle " + std::to_string(chunk) +
                            " is not a chunk of this pool in use (unknown or already given "
                            "back)");
    given_out_.erase(it);
    cached_.push_back(chunk);  // within the capacity reserved above
  }
}

void PhysicalChunkPool::take_cached(std::vector<physical_handle>& out, std::size_t want) {
  std::lock_guard<std::mutex> lock(mutex_);
  while (out.size() < want && !cached_.empty()) {
    const physical_handle h = cached_.back();
    given_out_.insert(h);  // may throw bad_alloc: then the chunk is still cached
    cached_.pop_back();
    out.push_back(h);      // within the caller's capacity
  }
}

void PhysicalChunkPool::reserve_cache(std::size_t more) {
  std::lock_guard<std::mutex> lock(mutex_);
  cached_.reserve(cached_.size() + more);
}

void PhysicalChunkPool::release(physical_handle chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = given_out_.find(chunk);
  if (it == given_out_.end())
    throw InvalidArgument("PhysicalChunkPool: handle " + std::to_string(chunk) +
                          " is not a chunk of this pool in use (unknown or already given back)");
  device_->release(chunk);
  given_out_.erase(it);
  ++released_;
}

std::size_t PhysicalChunkPool::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t bytes = 0;
  while (!cached_.empty()) {
    device_->release(cached_.back());  // a failure leaves the rest cached, accounts exact
    cached_.pop_back();
    ++released_;
    bytes += chunk_size_;
  }
  return bytes;
}

std::size_t PhysicalChunkPool::creatable_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t held = cached_.size() + given_out_.size();
  std::size_t n = held < max_pool_chunks ? max_pool_chunks - held : 0;
  if (budget_ != 0) n = budget_ / chunk_size_ > held ? budget_ / chunk_size_ - held : 0;
  const std::size_t capacity = device_->capacity();
  if (capacity != 0) {
    const std::size_t used = device_->physical_bytes_in_use();
    n = std::min(n, capacity > used ? (capacity - used) / chunk_size_ : 0);
  }
  return n;
}

ChunkPoolStats PhysicalChunkPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ChunkPoolStats s;
  s.chunk_size = chunk_size_;
  s.budget_bytes = budget_;
  s.chunks_held = cached_.size() + given_out_.size();
  s.peak_chunks_held = peak_held_;
  s.chunks_cached = cached_.size();
  s.chunks_created = created_;
  s.chunks_released = released_;
  return s;
}

std::size_t PhysicalChunkPool::chunks_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_.size() + given_out_.size();
}

std::size_t PhysicalChunkPool::chunks_cached() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_.size();
}

}  // namespace vmalloc
