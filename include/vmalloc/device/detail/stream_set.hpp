// The streams and events of one emulated device, with the CUDA legacy default stream's
// ordering: work on stream 0 waits for all work queued before it on every other blocking
// stream, and work on a blocking stream waits for the default stream's work queued before it.
// Non-blocking streams (CU_STREAM_NON_BLOCKING, what CudaDevice creates) order with neither.
//
// Handles of streams and events come from one counter, so passing one kind for the other is
// caught (DeviceError code invalid_handle). A queued item that faults records the fault here;
// the next synchronization reports it once (CUDA keeps it forever; an emulator that stays
// usable after a deliberate fault is more useful for tests). A destroyed stream's queued
// work still runs, as in CUDA: the stream is retired, not waited for.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "vmalloc/device/detail/stream_worker.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

class StreamSet {
 public:
  // `device_name` prefixes error messages ("host:0").
  explicit StreamSet(std::string device_name);
  ~StreamSet();  // drains every stream
  StreamSet(const StreamSet&) = delete;
  StreamSet& operator=(const StreamSet&) = delete;

  // Every method below that takes an `entry` point name throws DeviceError(entry,
  // invalid_handle) for an unknown stream or event handle, and then changes nothing.
  // `non_blocking`: no implicit ordering with the default stream (CU_STREAM_NON_BLOCKING).
  stream_t create_stream(bool non_blocking = false);
  void destroy_stream(stream_t stream, const char* entry);  // does not wait
  event_t create_event();
  void destroy_event(event_t event, const char* entry);
  void record(event_t event, stream_t stream, const char* entry);
  bool query(event_t event, const char* entry);
  void wait_event_host(event_t event, const char* entry);
  void stream_wait_event(stream_t stream, event_t event, const char* entry);

  // Where a queued item can be waited for.
  struct Ticket {
    std::shared_ptr<StreamWorker> stream;
    std::uint64_t seq = 0;
    void wait() const { stream->wait(seq); }
  };
  // Throws for an unknown stream (nothing queued then).
  void check_stream(stream_t stream, const char* entry) const;
  Ticket enqueue(stream_t stream, StreamWorker::Task task, const char* entry);
  // Runs `task` on the calling thread, as the stream's next item, when it would not wait for
  // anything (nothing queued on `stream`, no implicit dependency on another stream's work);
  // returns false, running nothing, otherwise. `task` must not throw.
  bool run_if_idle(stream_t stream, const std::function<void()>& task, const char* entry);
  void synchronize_stream(stream_t stream, const char* entry);
  void synchronize_all();

  // Holds: an item that blocks `stream` until released (a kernel that runs until told to
  // stop), so tests can observe queued, not yet executed work. Released holds, and all
  // holds when the set is destroyed, let the stream go on. Returns the hold's id.
  std::uint64_t hold(stream_t stream, const char* entry);
  // Throws DeviceError(entry, invalid_handle) for an unknown or already released hold.
  void release_hold(std::uint64_t hold, const char* entry);

  std::size_t streams() const;  // created ones; the default stream is not counted
  // Whether `stream` was created and then destroyed here (handles are never reused). Cheap
  // (no lock) while no stream has been destroyed.
  bool destroyed(stream_t stream) const;
  std::size_t events() const;

  // Called by a faulting item (any thread); kept until reported.
  void record_fault(const std::string& message);
  // Throws DeviceError(entry, illegal_address) for a fault recorded since the last report.
  void report_fault(const char* entry);

 private:
  struct Gate;
  struct Event {
    std::shared_ptr<StreamWorker> stream;  // null: never recorded, so complete
    std::uint64_t seq = 0;
  };
  std::shared_ptr<StreamWorker> stream_locked(stream_t stream, const char* entry) const;
  Event& event_locked(event_t event, const char* entry);
  // Adds to `deps` the default stream's implicit ordering for an item on `worker` (handle
  // `stream`); drops from the busy set the streams found done.
  void add_implicit_deps_locked(stream_t stream, const std::shared_ptr<StreamWorker>& worker,
                                std::vector<StreamDependency>& deps);
  // Queues on `worker` (handle `stream`) with the default stream's implicit ordering.
  Ticket enqueue_locked(stream_t stream, const std::shared_ptr<StreamWorker>& worker,
                        StreamWorker::Task task, std::vector<StreamDependency> deps);
  // Drops retired streams whose work is done (returned, to be released unlocked).
  std::vector<std::shared_ptr<StreamWorker>> prune_retired_locked();
  [[noreturn]] void invalid(const char* entry, const char* what, std::uintptr_t handle) const;

  const std::string device_name_;
  mutable std::mutex mutex_;  // the maps and the fault; never held while waiting for work
  std::unordered_map<stream_t, std::shared_ptr<StreamWorker>> streams_;
  // Live streams that may have work not yet seen complete: what synchronize_all and the
  // default stream's implicit ordering visit, so that their cost follows the streams in use,
  // not every stream ever created (a replay of 100 k streams was quadratic).
  std::unordered_set<stream_t> busy_;
  std::unordered_map<event_t, Event> events_;
  std::vector<std::shared_ptr<StreamWorker>> retired_;  // destroyed with work still queued
  std::unordered_set<stream_t> destroyed_;               // every stream destroyed so far
  std::atomic<bool> any_destroyed_{false};
  std::unordered_map<std::uint64_t, std::shared_ptr<Gate>> holds_;
  std::uint64_t next_hold_ = 1;
  std::uintptr_t next_handle_ = 1;
  std::string fault_;
};

}  // namespace vmalloc::detail
