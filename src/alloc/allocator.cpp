#include "vmalloc/alloc/allocator.hpp"

#include <algorithm>

#include "vmalloc/base/errors.hpp"

namespace vmalloc {

std::vector<std::pair<device_ptr, std::size_t>> Allocator::live_allocations() const {
  throw InvalidArgument("allocator \"" + name() + "\" cannot list its live allocations");
}

}  // namespace vmalloc

namespace vmalloc {

void Allocator::add_free_observer(std::shared_ptr<FreeObserver> observer) {
  if (!observer) throw InvalidArgument("add_free_observer: observer is null");
  std::lock_guard<std::mutex> lock(observers_mutex_);
  auto next = observers_ ? std::make_shared<std::vector<std::shared_ptr<FreeObserver>>>(*observers_)
                         : std::make_shared<std::vector<std::shared_ptr<FreeObserver>>>();
  next->push_back(std::move(observer));
  observers_ = std::move(next);
  observed_.store(true, std::memory_order_release);
}

void Allocator::remove_free_observer(const FreeObserver* observer) noexcept {
  std::lock_guard<std::mutex> lock(observers_mutex_);
  if (!observers_) return;
  try {
    auto next = std::make_shared<std::vector<std::shared_ptr<FreeObserver>>>(*observers_);
    next->erase(std::remove_if(next->begin(), next->end(),
                               [&](const auto& o) { return o.get() == observer; }),
                next->end());
    observed_.store(!next->empty(), std::memory_order_release);
    observers_ = next->empty() ? nullptr : std::move(next);
  } catch (...) {
    // No memory for a copy: the observer stays registered; it must then ignore calls
    // (the SwapManager detaches its own before going).
  }
}

bool Allocator::notify_free(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  std::shared_ptr<const std::vector<std::shared_ptr<FreeObserver>>> snapshot;
  {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    snapshot = observers_;
  }
  if (!snapshot) return false;
  for (const auto& o : *snapshot)
    if (o->before_free(ptr, nbytes, stream)) return true;
  return false;
}

}  // namespace vmalloc
