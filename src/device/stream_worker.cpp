#include "vmalloc/device/detail/stream_worker.hpp"

namespace vmalloc::detail {

StreamWorker::~StreamWorker() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return completed_ == enqueued_; });
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::uint64_t StreamWorker::enqueue(Task task, std::vector<StreamDependency> deps) {
  // Checked before taking this stream's lock: never hold two streams' locks at once.
  // (A dependency once done stays done.)
  bool deps_done = true;
  for (const auto& d : deps) deps_done = deps_done && d.stream->done(d.seq);
  std::unique_lock<std::mutex> lock(mutex_);
  if (!task && queue_.empty()) {
    if (deps_done) {  // nothing to wait for: the marker is complete as soon as it exists
      ++enqueued_;
      ++completed_;
      return enqueued_;
    }
  }
  queue_.push_back(Item{std::move(task), std::move(deps)});
  const std::uint64_t seq = ++enqueued_;
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  lock.unlock();
  changed_.notify_all();
  return seq;
}

std::uint64_t StreamWorker::last_enqueued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return enqueued_;
}

bool StreamWorker::done(std::uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= seq;
}

void StreamWorker::wait(std::uint64_t seq) const {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return completed_ >= seq; });
}

std::uint64_t StreamWorker::begin_caller_run() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!queue_.empty()) return 0;
  queue_.push_back(Item{nullptr, {}, true});
  return ++enqueued_;
}

void StreamWorker::end_caller_run() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.pop_front();  // the caller's item: first, as nothing was queued before it
    ++completed_;
  }
  changed_.notify_all();  // waiters on it, and the thread if work was queued behind it
}

void StreamWorker::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    // An item its caller runs stays at the front until end_caller_run pops it.
    changed_.wait(lock,
                  [this] { return stopping_ || (!queue_.empty() && !queue_.front().caller_runs); });
    if (queue_.empty()) return;  // stopping, and drained
    // The item stays at the front until done, so "queue empty" means "all complete".
    Item& item = queue_.front();
    lock.unlock();
    for (const auto& d : item.deps) d.stream->wait(d.seq);
    if (item.task) item.task();
    lock.lock();
    Item finished = std::move(queue_.front());
    queue_.pop_front();
    ++completed_;
    changed_.notify_all();
    // Dropping the item may drop the last reference to another stream, whose destructor
    // drains it: do that outside this stream's lock, after the completion is visible.
    lock.unlock();
    finished = Item{};
    lock.lock();
  }
}

}  // namespace vmalloc::detail
