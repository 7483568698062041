#include "vmalloc/chunks/detail/stream_order.hpp"

#include <atomic>
#include <utility>

#include "vmalloc/base/errors.hpp"

namespace vmalloc::detail {

std::uintptr_t stream_thread_index() noexcept {
  static std::atomic<std::uintptr_t> next{1};
  thread_local const std::uintptr_t index = next.fetch_add(1, std::memory_order_relaxed);
  return index;
}

StreamOrder::~StreamOrder() {
  for (const Slot& slot : slots_) {
    try {
      device_->destroy_event(slot.handle);
    } catch (...) {
      // Teardown: a failing device must not take the process down with it.
    }
  }
}

std::uint32_t StreamOrder::record(stream_t stream) {
  std::uint32_t index;
  if (!free_slots_.empty()) {
    index = free_slots_.back();
    device_->record_event(slots_[index].handle, stream_handle_of(stream));  // throws: stays free
    free_slots_.pop_back();
  } else {
    slots_.reserve(slots_.size() + 1);
    free_slots_.reserve(slots_.size() + 1);  // so unref() never allocates
    const event_t handle = device_->create_event();
    try {
      device_->record_event(handle, stream_handle_of(stream));
    } catch (...) {
      // Keep the event for later rather than destroying it: it is a valid, idle event.
      slots_.push_back(Slot{handle, 0});
      free_slots_.push_back(static_cast<std::uint32_t>(slots_.size() - 1));
      throw;
    }
    slots_.push_back(Slot{handle, 0});
    index = static_cast<std::uint32_t>(slots_.size() - 1);
  }
  slots_[index].refs = 1;
  return index;
}

PendingWork StreamOrder::on_free_slow(stream_t stream) {
  const bool multi = multi_stream_ || (have_first_ && stream != first_stream_);
  PendingWork work;
  work.stream = stream;
  work.idle = false;
  // Only stream 0 may be left without an event (see the header): its owner cannot destroy it.
  if (multi || stream != 0) work.event = record(stream);  // may throw: nothing changed yet
  note_stream(stream);
  work.seq = ++seq_;
  return work;
}

bool StreamOrder::settle_or_record(PendingWork& work) {
  if (work.idle) return false;
  if (work.event != no_event) return true;
  if (work.seq <= synced_seq_) {  // done at an earlier device synchronize
    drop(work);
    return false;
  }
  // Freed on stream 0 while it was the only stream, so no event was recorded: stream 0 always
  // exists, so one is recorded on it now. (Any other stream may have been destroyed by its
  // owner since the free: never used here. on_free records their events at once, so this is
  // a safety net: wait for the whole device, which also settles every earlier free.)
  if (work.stream == 0) {
    work.event = record(work.stream);  // may throw: `work` unchanged
    return true;
  }
  const std::uint64_t seq = seq_;
  device_->synchronize();  // may throw: `work` unchanged
  synced_seq_ = seq;
  drop(work);
  return false;
}

bool StreamOrder::completed(PendingWork& work) {
  if (work.idle) return true;
  if (work.event == no_event) return false;  // unknown without recording: assume running
  if (!device_->query_event(slots_[work.event].handle)) return false;
  drop(work);
  return true;
}

void StreamOrder::make_usable_on_slow(PendingWork& work, stream_t stream) {
  if (!settle_or_record(work)) return;
  if (device_->query_event(slots_[work.event].handle)) {
    drop(work);
    return;
  }
  device_->wait_event(stream_handle_of(stream), slots_[work.event].handle);
}

void StreamOrder::synchronize(PendingWork& work) {
  if (!settle_or_record(work)) return;
  device_->synchronize_event(slots_[work.event].handle);
  drop(work);
}

}  // namespace vmalloc::detail
