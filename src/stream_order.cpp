#include "vmalloc/detail/stream_order.hpp"

#include <utility>

#include "vmalloc/errors.hpp"

namespace vmalloc::detail {

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
    device_->record_event(slots_[index].handle, stream);  // throws: slot stays free
    free_slots_.pop_back();
  } else {
    slots_.reserve(slots_.size() + 1);
    free_slots_.reserve(slots_.size() + 1);  // so unref() never allocates
    const event_t handle = device_->create_event();
    try {
      device_->record_event(handle, stream);
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
  if (multi) work.event = record(stream);  // may throw: nothing changed yet
  note_stream(stream);
  work.seq = ++seq_;
  return work;
}

bool StreamOrder::settle_or_record(PendingWork& work) {
  if (work.idle) return false;
  if (work.event != no_event) return true;
  try {
    work.event = record(work.stream);
    return true;
  } catch (const Error&) {
    // The freeing stream is gone (destroyed since the free). The driver finishes a destroyed
    // stream's work on its own; waiting for the whole device covers it.
    device_->synchronize();
    drop(work);
    return false;
  }
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
  device_->wait_event(stream, slots_[work.event].handle);
}

void StreamOrder::synchronize(PendingWork& work) {
  if (!settle_or_record(work)) return;
  device_->synchronize_event(slots_[work.event].handle);
  drop(work);
}

}  // namespace vmalloc::detail
