// The replay engine: feeds a recorded allocation trace into any Allocator, as fast as the
// allocator goes, and keeps what the fragmentation study needs (peaks, a downsampled timeline
// of requested and reserved bytes, where it ran out of memory).
//
// Trace addresses are the addresses the recording allocator returned; the engine maps each to
// the pointer the replaying allocator returns. Trace streams are mapped to streams created on
// the allocator's device (trace stream 0 is the default stream), so the allocators'
// stream-ordered reuse rules apply as they did in the recorded job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc {

// One trace event, laid out exactly as vmalloc.traces.events.EVENT_DTYPE (aligned NumPy
// struct), so batches from Python are read in place.
struct TraceEvent {
  std::uint8_t op;  // op_alloc or op_free
  std::uint64_t stream;
  std::uint64_t addr;
  std::uint64_t size;

  static constexpr std::uint8_t op_alloc = 0;  // events.ALLOC
  static constexpr std::uint8_t op_free = 1;   // events.FREE
};
static_assert(sizeof(TraceEvent) == 32, "TraceEvent must match EVENT_DTYPE (32 bytes)");
static_assert(offsetof(TraceEvent, stream) == 8 && offsetof(TraceEvent, addr) == 16 &&
                  offsetof(TraceEvent, size) == 24,
              "TraceEvent offsets must match EVENT_DTYPE");

struct ReplayOptions {
  // The timeline keeps between timeline_points and 2 * timeline_points buckets whatever the
  // trace length; 0 keeps no timeline (bisection probes need none).
  std::size_t timeline_points = 2048;
  // Stop at the first allocation that runs out of memory (the result then reports where);
  // otherwise count it and go on as if the allocation had not happened.
  bool stop_on_out_of_memory = true;
};

// One timeline bucket: the events [first_event, first_event + stride) and the largest
// requested and reserved byte counts seen after any of them (maxima keep the peaks visible
// however coarse the buckets get).
struct TimelinePoint {
  std::uint64_t first_event = 0;
  std::size_t requested_bytes = 0;
  std::size_t reserved_bytes = 0;
};

// What the engine observed, beyond the allocator's own Stats.
struct ReplayCounts {
  std::uint64_t events = 0;          // events consumed (the one that ran out of memory included)
  std::uint64_t allocations = 0;     // alloc events that succeeded
  std::uint64_t frees = 0;           // free events matched to a live allocation
  std::uint64_t unknown_frees = 0;   // frees of an address not live in the trace (ring-buffer
                                     // snapshots lose allocs; double frees): counted, skipped
  std::uint64_t reused_addresses = 0;  // allocs of an address still live (its free was lost):
                                       // the old allocation is freed first
  std::uint64_t out_of_memory_count = 0;
  std::int64_t out_of_memory_event = -1;  // index of the first alloc that ran out, or -1
  std::size_t out_of_memory_request_bytes = 0;
  std::size_t live_allocations = 0;
  std::size_t requested_bytes = 0;        // live bytes the trace asked for, now
  std::size_t peak_requested_bytes = 0;   // and at most
  std::size_t streams = 0;                // distinct trace streams seen
};

class Replay {
 public:
  Replay(std::shared_ptr<Allocator> allocator, ReplayOptions options = {});
  // Frees what the trace left live and destroys the streams the replay created.
  ~Replay();
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

  // Replays `n` events. Returns false once the run has stopped (it ran out of memory with
  // stop_on_out_of_memory); later calls then consume nothing. A batch with an op other than
  // alloc or free is rejected whole with InvalidArgument before any of it runs. Any other
  // allocator error is rethrown with the event index in its message.
  bool feed(const TraceEvent* events, std::size_t n);

  bool stopped() const;
  ReplayCounts counts() const;
  std::vector<TimelinePoint> timeline() const;
  // Events per timeline bucket now (a power of two).
  std::uint64_t timeline_stride() const;
  const std::shared_ptr<Allocator>& allocator() const { return allocator_; }

 private:
  struct Live {
    device_ptr ptr;
    std::size_t size;
    stream_t stream;
  };

  stream_t device_stream(std::uint64_t trace_stream);
  void replay_alloc(const TraceEvent& e, std::uint64_t index);
  void replay_free(const TraceEvent& e, std::uint64_t index);
  void record_timeline(std::uint64_t index);
  void release_all() noexcept;

  const std::shared_ptr<Allocator> allocator_;
  const ReplayOptions options_;
  mutable std::mutex mutex_;
  bool stopped_ = false;
  ReplayCounts counts_;
  std::unordered_map<std::uint64_t, Live> live_;  // trace address -> replayed allocation
  std::unordered_map<std::uint64_t, stream_t> streams_;  // trace stream -> device stream
  std::vector<stream_t> created_streams_;
  bool seen_default_stream_ = false;
  std::uint64_t last_trace_stream_ = 0;  // one-entry cache in front of streams_ (0 = empty)
  stream_t last_device_stream_ = 0;
  // Downsampled timeline: closed buckets plus the one being filled.
  std::vector<TimelinePoint> timeline_;
  TimelinePoint open_bucket_;
  std::uint64_t open_count_ = 0;
  std::uint64_t stride_ = 1;
};

}  // namespace vmalloc
