// One emulated stream: an ordered queue of work run by its own thread.
//
// Items run strictly in the order they were queued. An item may depend on other streams'
// items (event waits, the legacy default stream's implicit ordering): its worker waits for
// them before running it. Dependencies always point at items queued earlier, so they never
// form a cycle. The thread starts with the first item that needs it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace vmalloc::detail {

class StreamWorker;

// "Item `seq` of `stream` must be done first."
struct StreamDependency {
  std::shared_ptr<StreamWorker> stream;
  std::uint64_t seq = 0;
};

class StreamWorker {
 public:
  // Runs on the worker thread. Must not throw: errors are the task's own to report.
  using Task = std::function<void()>;

  // `non_blocking`: created CU_STREAM_NON_BLOCKING, so it has no implicit ordering with the
  // legacy default stream (StreamSet applies that ordering; the worker only records it).
  explicit StreamWorker(bool non_blocking = false) : non_blocking_(non_blocking) {}
  // Drains the queue, then joins the thread. Never called from the worker's own thread
  // (no item depends on its own stream).
  ~StreamWorker();
  StreamWorker(const StreamWorker&) = delete;
  StreamWorker& operator=(const StreamWorker&) = delete;

  // Queues `task` (may be empty: a marker) to run after `deps`; returns its sequence number
  // (1, 2, ...). A marker with nothing pending completes at once, without a thread.
  std::uint64_t enqueue(Task task, std::vector<StreamDependency> deps = {});
  // The sequence number of the last item queued (0 if none).
  std::uint64_t last_enqueued() const;
  bool done(std::uint64_t seq) const;
  // Blocks until item `seq` and everything before it has run.
  void wait(std::uint64_t seq) const;
  void drain() const { wait(last_enqueued()); }
  // A caller's run in place of the thread: if nothing is queued, queues an item that the
  // calling thread runs itself and returns its sequence number (later items wait for it as
  // for any other); else returns 0 and queues nothing. The caller then runs its work and
  // calls end_caller_run() (exactly once, also when the work fails).
  std::uint64_t begin_caller_run();
  void end_caller_run();
  bool non_blocking() const noexcept { return non_blocking_; }

 private:
  struct Item {
    Task task;
    std::vector<StreamDependency> deps;
    bool caller_runs = false;  // begin_caller_run's: the worker thread leaves it alone
  };
  void run();

  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;  // new work, a completion, or stopping
  std::deque<Item> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  const bool non_blocking_;
  std::thread thread_;
};

}  // namespace vmalloc::detail
