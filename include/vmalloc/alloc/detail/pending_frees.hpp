// Stream-ordered frees for the caching allocator: a block freed while other streams may still
// use it gets one event per such stream, recorded at free time; it goes back to its pool once
// every event has completed (PyTorch's insert_events / process_events). Events come from a
// small pool, so a steady state creates none. Streams are stream keys (detail::stream_key):
// a CU_STREAM_PER_THREAD key must be passed from its own thread.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "vmalloc/alloc/detail/caching_block.hpp"
#include "vmalloc/device/device.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

class PendingFrees {
 public:
  explicit PendingFrees(Device& device) : device_(device) {}
  // Waits for outstanding events and destroys every event (best effort, never throws).
  ~PendingFrees();
  PendingFrees(const PendingFrees&) = delete;
  PendingFrees& operator=(const PendingFrees&) = delete;

  // Records an event on each of `streams` (non-empty) and sets block->pending_events. Throws
  // DeviceError (e.g. an unknown stream) with nothing recorded and the block untouched.
  void record(CachingBlock* block, const std::vector<stream_t>& streams);

  // Throws DeviceError if `stream` is not a stream of the device: records an idle event on
  // it (the device has no cheaper way to ask).
  void check_stream(stream_t stream);

  // Calls on_free(block) for each block whose last event has completed, without blocking.
  // Per stream, events complete in order, so each stream's queue is checked only up to its
  // first incomplete event. A device error stops the walk; blocks already handed to on_free
  // stay handed.
  void collect_completed(const std::function<void(CachingBlock*)>& on_free);
  // Waits for every event, calling on_free(block) for each block that becomes free.
  void synchronize_all(const std::function<void(CachingBlock*)>& on_free);

  // Blocks waiting (a block waiting on several streams counts once).
  std::size_t blocks_waiting() const noexcept { return blocks_waiting_; }
  std::size_t idle_events() const noexcept { return idle_.size(); }

 private:
  event_t acquire_event();
  // Marks one of the block's events complete; true when it was the last.
  bool complete(CachingBlock* block, event_t event);

  Device& device_;
  std::vector<event_t> idle_;
  std::map<stream_t, std::deque<std::pair<event_t, CachingBlock*>>> waiting_;
  std::size_t blocks_waiting_ = 0;
};

}  // namespace vmalloc::detail
