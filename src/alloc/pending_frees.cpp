#include "vmalloc/alloc/detail/pending_frees.hpp"

#include "vmalloc/chunks/detail/stream_order.hpp"

namespace vmalloc::detail {

PendingFrees::~PendingFrees() {
  for (auto& [stream, queue] : waiting_) {
    for (auto& [event, block] : queue) {
      try {
        device_.synchronize_event(event);
      } catch (...) {
      }
      idle_.push_back(event);
    }
  }
  waiting_.clear();
  for (event_t e : idle_) {
    try {
      device_.destroy_event(e);
    } catch (...) {
    }
  }
}

event_t PendingFrees::acquire_event() {
  if (idle_.empty()) return device_.create_event();
  event_t e = idle_.back();
  idle_.pop_back();
  return e;
}

void PendingFrees::check_stream(stream_t stream) {
  event_t e = acquire_event();
  try {
    device_.record_event(e, stream_handle_of(stream));
  } catch (...) {
    idle_.push_back(e);
    throw;
  }
  idle_.push_back(e);
}

void PendingFrees::record(CachingBlock* block, const std::vector<stream_t>& streams) {
  std::vector<event_t> events;
  events.reserve(streams.size());
  try {
    for (stream_t s : streams) {
      events.push_back(acquire_event());
      device_.record_event(events.back(), stream_handle_of(s));
    }
    // Make room first so that the pushes below cannot fail half way.
    for (stream_t s : streams) waiting_[s];
  } catch (...) {
    // A recorded event is harmless in the idle pool: recording it again overwrites it.
    idle_.insert(idle_.end(), events.begin(), events.end());
    throw;
  }
  for (std::size_t i = 0; i < streams.size(); ++i)
    waiting_[streams[i]].emplace_back(events[i], block);
  block->pending_events = static_cast<int>(streams.size());
  ++blocks_waiting_;
}

bool PendingFrees::complete(CachingBlock* block, event_t event) {
  idle_.push_back(event);
  if (--block->pending_events > 0) return false;
  --blocks_waiting_;
  return true;
}

void PendingFrees::collect_completed(const std::function<void(CachingBlock*)>& on_free) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    auto& queue = it->second;
    while (!queue.empty() && device_.query_event(queue.front().first)) {
      auto [event, block] = queue.front();
      queue.pop_front();
      if (complete(block, event)) on_free(block);
    }
    it = queue.empty() ? waiting_.erase(it) : std::next(it);
  }
}

void PendingFrees::synchronize_all(const std::function<void(CachingBlock*)>& on_free) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      device_.synchronize_event(queue.front().first);
      auto [event, block] = queue.front();
      queue.pop_front();
      if (complete(block, event)) on_free(block);
    }
    it = waiting_.erase(it);
  }
}

}  // namespace vmalloc::detail
