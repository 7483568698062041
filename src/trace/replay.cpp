#include "vmalloc/trace/replay.hpp"

#include <algorithm>
#include <string>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc {

using detail::hex;

namespace {

std::string describe(const TraceEvent& e, std::uint64_t index) {
  return std::string("trace event ") + std::to_string(index) + " (" +
         (e.op == TraceEvent::op_alloc ? "alloc" : "free") + " of " + std::to_string(e.size) +
         " bytes at trace address " + hex(e.addr) + " on stream " + hex(e.stream) + "): ";
}

// Rethrows the vmalloc error being handled, same type, with `context` before its message, so
// a failure deep in a long trace says which event caused it.
[[noreturn]] void rethrow_with(const std::string& context) {
  try {
    throw;
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(context + e.what(), e.requested(), e.state());
  } catch (const InvalidPointer& e) {
    throw InvalidPointer(context + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(context + e.what());
  } catch (const DeviceError& e) {
    throw DeviceError(context + e.what(), e.call(), e.code());
  } catch (const Error& e) {
    throw Error(context + e.what());
  }
}

}  // namespace

Replay::Replay(std::shared_ptr<Allocator> allocator, ReplayOptions options)
    : allocator_(std::move(allocator)), options_(options) {
  if (!allocator_) throw InvalidArgument("Replay needs an allocator, got none");
  if (options_.timeline_points > (std::size_t{1} << 24))
    throw InvalidArgument("timeline_points " + std::to_string(options_.timeline_points) +
                          " is too large (at most 2**24)");
  timeline_.reserve(2 * options_.timeline_points);
}

Replay::~Replay() { release_all(); }

void Replay::release_all() noexcept {
  // Best effort: a destructor must not throw, and a failure here cannot be reported anyway.
  for (auto& entry : live_) {
    try {
      allocator_->deallocate(entry.second.ptr, entry.second.size, entry.second.stream);
    } catch (...) {
    }
  }
  live_.clear();
  const auto& device = allocator_->device();
  if (!device || created_streams_.empty()) return;
  try {
    device->synchronize();
  } catch (...) {
  }
  for (stream_t s : created_streams_) {
    try {
      device->destroy_stream(s);
    } catch (...) {
    }
  }
  created_streams_.clear();
}

stream_t Replay::device_stream(std::uint64_t trace_stream) {
  if (trace_stream == 0) {
    if (!seen_default_stream_) {
      seen_default_stream_ = true;
      ++counts_.streams;
    }
    return 0;
  }
  if (trace_stream == last_trace_stream_) return last_device_stream_;
  auto it = streams_.find(trace_stream);
  if (it == streams_.end()) {
    const auto& device = allocator_->device();
    if (!device) throw InvalidArgument("the allocator has no device to create trace streams on");
    stream_t s = device->create_stream();
    try {
      created_streams_.push_back(s);
    } catch (...) {
      device->destroy_stream(s);
      throw;
    }
    it = streams_.emplace(trace_stream, s).first;
    ++counts_.streams;
  }
  last_trace_stream_ = trace_stream;
  last_device_stream_ = it->second;
  return it->second;
}

bool Replay::feed(const TraceEvent* events, std::size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (n == 0 || stopped_) return !stopped_;
  if (events == nullptr) throw InvalidArgument("Replay::feed: null events with n > 0");
  // Validate the whole batch first so that a malformed one changes nothing.
  for (std::size_t i = 0; i < n; ++i) {
    if (events[i].op != TraceEvent::op_alloc && events[i].op != TraceEvent::op_free)
      throw InvalidArgument("trace event " + std::to_string(counts_.events + i) + " has op " +
                            std::to_string(events[i].op) +
                            "; expected 0 (alloc) or 1 (free); nothing in its batch was replayed");
  }
  for (std::size_t i = 0; i < n && !stopped_; ++i) {
    const TraceEvent& e = events[i];
    const std::uint64_t index = counts_.events;
    try {
      if (e.op == TraceEvent::op_alloc)
        replay_alloc(e, index);
      else
        replay_free(e, index);
    } catch (const Error&) {
      rethrow_with(describe(e, index));
    }
    ++counts_.events;
    record_timeline(index);
  }
  return !stopped_;
}

void Replay::replay_alloc(const TraceEvent& e, std::uint64_t index) {
  const stream_t stream = device_stream(e.stream);
  auto it = live_.find(e.addr);
  if (it != live_.end()) {
    // The recording allocator handed this address out again, so its free was lost (a
    // ring-buffer snapshot): end the old allocation as the recorded job must have.
    allocator_->deallocate(it->second.ptr, it->second.size, it->second.stream);
    counts_.requested_bytes -= it->second.size;
    live_.erase(it);
    ++counts_.reused_addresses;
  }
  device_ptr ptr;
  try {
    ptr = allocator_->allocate(e.size, stream);
  } catch (const OutOfMemory&) {
    if (counts_.out_of_memory_count++ == 0) {
      counts_.out_of_memory_event = static_cast<std::int64_t>(index);
      counts_.out_of_memory_request_bytes = e.size;
    }
    if (options_.stop_on_out_of_memory) stopped_ = true;
    return;
  }
  try {
    live_.emplace(e.addr, Live{ptr, static_cast<std::size_t>(e.size), stream});
  } catch (...) {
    allocator_->deallocate(ptr, e.size, stream);
    throw;
  }
  ++counts_.allocations;
  counts_.requested_bytes += e.size;
  counts_.peak_requested_bytes = std::max(counts_.peak_requested_bytes, counts_.requested_bytes);
}

void Replay::replay_free(const TraceEvent& e, std::uint64_t) {
  auto it = live_.find(e.addr);
  if (it == live_.end()) {
    ++counts_.unknown_frees;
    return;
  }
  allocator_->deallocate(it->second.ptr, it->second.size, device_stream(e.stream));
  counts_.requested_bytes -= it->second.size;
  live_.erase(it);
  ++counts_.frees;
}

void Replay::record_timeline(std::uint64_t index) {
  const std::size_t points = options_.timeline_points;
  if (points == 0) return;
  const std::size_t requested = counts_.requested_bytes;
  const std::size_t reserved = allocator_->stats().reserved_bytes;
  if (open_count_ == 0) {
    open_bucket_ = TimelinePoint{index, requested, reserved};
  } else {
    open_bucket_.requested_bytes = std::max(open_bucket_.requested_bytes, requested);
    open_bucket_.reserved_bytes = std::max(open_bucket_.reserved_bytes, reserved);
  }
  if (++open_count_ < stride_) return;
  timeline_.push_back(open_bucket_);
  open_count_ = 0;
  if (timeline_.size() < 2 * points) return;
  // Full: merge neighbours pairwise, halving the resolution, so memory stays bounded.
  const std::size_t half = timeline_.size() / 2;
  for (std::size_t i = 0; i < half; ++i) {
    const TimelinePoint& a = timeline_[2 * i];
    const TimelinePoint& b = timeline_[2 * i + 1];
    timeline_[i] = TimelinePoint{a.first_event, std::max(a.requested_bytes, b.requested_bytes),
                                 std::max(a.reserved_bytes, b.reserved_bytes)};
  }
  timeline_.resize(half);
  stride_ *= 2;
}

bool Replay::stopped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stopped_;
}

ReplayCounts Replay::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ReplayCounts out = counts_;
  out.live_allocations = live_.size();
  return out;
}

std::vector<TimelinePoint> Replay::timeline() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<TimelinePoint> out(timeline_);
  if (open_count_ > 0) out.push_back(open_bucket_);
  return out;
}

std::uint64_t Replay::timeline_stride() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stride_;
}

}  // namespace vmalloc
