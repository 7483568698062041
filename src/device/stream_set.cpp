#include "vmalloc/device/detail/stream_set.hpp"

#include <condition_variable>
#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc::detail {

StreamSet::StreamSet(std::string device_name) : device_name_(std::move(device_name)) {
  streams_.emplace(0, std::make_shared<StreamWorker>());
}

struct StreamSet::Gate {
  std::mutex mutex;
  std::condition_variable opened;
  bool open = false;
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      open = true;
    }
    opened.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    opened.wait(lock, [this] { return open; });
  }
};

StreamSet::~StreamSet() {
  std::unordered_map<std::uint64_t, std::shared_ptr<Gate>> holds;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    holds.swap(holds_);
  }
  for (auto& [id, gate] : holds) gate->release();  // nothing may block the drain below
  synchronize_all();
}

std::vector<std::shared_ptr<StreamWorker>> StreamSet::prune_retired_locked() {
  std::vector<std::shared_ptr<StreamWorker>> done;
  for (auto it = retired_.begin(); it != retired_.end();) {
    if ((*it)->done((*it)->last_enqueued())) {
      done.push_back(std::move(*it));
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
  return done;
}

void StreamSet::invalid(const char* entry, const char* what, std::uintptr_t handle) const {
  throw DeviceError(std::string(entry) + " on " + device_name_ + ": unknown " + what + " " +
                        hex(handle) + " (never created, or already destroyed)",
                    entry, cu_result::invalid_handle);
}

std::shared_ptr<StreamWorker> StreamSet::stream_locked(stream_t stream, const char* entry) const {
  auto it = streams_.find(stream);
  if (it == streams_.end()) invalid(entry, "stream", stream);
  return it->second;
}

StreamSet::Event& StreamSet::event_locked(event_t event, const char* entry) {
  auto it = events_.find(event);
  if (it == events_.end()) invalid(entry, "event", event);
  return it->second;
}

stream_t StreamSet::create_stream(bool non_blocking) {
  auto worker = std::make_shared<StreamWorker>(non_blocking);
  std::vector<std::shared_ptr<StreamWorker>> done;  // released after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  done = prune_retired_locked();
  const stream_t id = next_handle_++;
  streams_.emplace(id, std::move(worker));
  return id;
}

void StreamSet::destroy_stream(stream_t stream, const char* entry) {
  std::shared_ptr<StreamWorker> worker;
  std::vector<std::shared_ptr<StreamWorker>> done;
  std::lock_guard<std::mutex> lock(mutex_);
  if (stream == 0)
    throw DeviceError(std::string(entry) + " on " + device_name_ +
                          ": the default stream (0) cannot be destroyed",
                      entry, cu_result::invalid_handle);
  worker = stream_locked(stream, entry);
  destroyed_.insert(stream);  // may throw bad_alloc: nothing changed yet
  streams_.erase(stream);
  busy_.erase(stream);
  any_destroyed_.store(true, std::memory_order_release);
  // Its queued work still runs (as in CUDA) and the call does not wait for it.
  if (!worker->done(worker->last_enqueued())) retired_.push_back(worker);
  done = prune_retired_locked();
}

bool StreamSet::destroyed(stream_t stream) const {
  if (stream == 0 || !any_destroyed_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return destroyed_.count(stream) != 0;
}

event_t StreamSet::create_event() {
  std::lock_guard<std::mutex> lock(mutex_);
  const event_t id = next_handle_++;
  events_.emplace(id, Event{});
  return id;
}

void StreamSet::destroy_event(event_t event, const char* entry) {
  Event removed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    removed = std::move(event_locked(event, entry));
    events_.erase(event);
  }
  // `removed` may hold the last reference to a destroyed stream: released here, unlocked.
}

void StreamSet::add_implicit_deps_locked(stream_t stream,
                                         const std::shared_ptr<StreamWorker>& worker,
                                         std::vector<StreamDependency>& deps) {
  if (stream == 0) {
    // Only streams with work not yet seen complete can order stream 0; those found complete
    // leave the busy set here.
    for (auto it = busy_.begin(); it != busy_.end();) {
      const auto& other = streams_.at(*it);
      const std::uint64_t seq = other->last_enqueued();
      if (other->done(seq)) {
        it = busy_.erase(it);
        continue;
      }
      if (*it != 0 && !other->non_blocking()) deps.push_back({other, seq});
      ++it;
    }
  } else if (!worker->non_blocking()) {
    const auto& legacy = streams_.at(0);
    const std::uint64_t seq = legacy->last_enqueued();
    if (!legacy->done(seq)) deps.push_back({legacy, seq});
  }
}

StreamSet::Ticket StreamSet::enqueue_locked(stream_t stream,
                                            const std::shared_ptr<StreamWorker>& worker,
                                            StreamWorker::Task task,
                                            std::vector<StreamDependency> deps) {
  add_implicit_deps_locked(stream, worker, deps);
  busy_.insert(stream);  // before the work is queued: a bad_alloc leaves nothing untracked
  const std::uint64_t seq = worker->enqueue(std::move(task), std::move(deps));
  return Ticket{worker, seq};
}

void StreamSet::check_stream(stream_t stream, const char* entry) const {
  std::lock_guard<std::mutex> lock(mutex_);
  stream_locked(stream, entry);
}

StreamSet::Ticket StreamSet::enqueue(stream_t stream, StreamWorker::Task task,
                                     const char* entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto worker = stream_locked(stream, entry);
  return enqueue_locked(stream, worker, std::move(task), {});
}

void StreamSet::record(event_t event, stream_t stream, const char* entry) {
  std::shared_ptr<StreamWorker> previous;  // released after the lock (see destroy_event)
  std::lock_guard<std::mutex> lock(mutex_);
  Event& e = event_locked(event, entry);
  auto worker = stream_locked(stream, entry);
  // A marker item: recording is itself work on the stream, so on the default stream it
  // also captures the other streams' earlier work.
  Ticket t = enqueue_locked(stream, worker, nullptr, {});
  previous = std::move(e.stream);
  e.stream = std::move(t.stream);
  e.seq = t.seq;
}

bool StreamSet::query(event_t event, const char* entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Event& e = event_locked(event, entry);
  return !e.stream || e.stream->done(e.seq);
}

void StreamSet::wait_event_host(event_t event, const char* entry) {
  Event e;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    e = event_locked(event, entry);
  }
  if (e.stream) e.stream->wait(e.seq);
}

void StreamSet::stream_wait_event(stream_t stream, event_t event, const char* entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto worker = stream_locked(stream, entry);
  const Event& e = event_locked(event, entry);
  std::vector<StreamDependency> deps;
  // Work on the event's own stream is already ordered after it; a dependency on itself
  // would also keep the stream alive from its own thread.
  if (e.stream && e.stream != worker && !e.stream->done(e.seq))
    deps.push_back({e.stream, e.seq});
  if (!deps.empty()) enqueue_locked(stream, worker, nullptr, std::move(deps));
}

bool StreamSet::run_if_idle(stream_t stream, const std::function<void()>& task,
                            const char* entry) {
  std::shared_ptr<StreamWorker> worker;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    worker = stream_locked(stream, entry);
    std::vector<StreamDependency> deps;
    add_implicit_deps_locked(stream, worker, deps);
    if (!deps.empty()) return false;
    busy_.insert(stream);  // before the item exists, as in enqueue_locked
    // Work queued from now on, here or on the default stream, is ordered after this item.
    if (worker->begin_caller_run() == 0) return false;
  }
  struct End {
    StreamWorker& worker;
    ~End() { worker.end_caller_run(); }
  } end{*worker};
  task();  // unlocked, as on the stream's thread
  return true;
}

void StreamSet::synchronize_stream(stream_t stream, const char* entry) {
  std::shared_ptr<StreamWorker> worker;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    worker = stream_locked(stream, entry);
  }
  // The stream's items already carry their implicit default-stream dependencies.
  worker->drain();
}

void StreamSet::synchronize_all() {
  std::vector<Ticket> tickets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (stream_t id : busy_) {
      const auto& worker = streams_.at(id);
      tickets.push_back({worker, worker->last_enqueued()});
    }
    for (const auto& worker : retired_) tickets.push_back({worker, worker->last_enqueued()});
  }
  for (const auto& t : tickets) t.wait();
  // Streams whose last item is done leave the busy set (work queued meanwhile keeps them).
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = busy_.begin(); it != busy_.end();) {
    const auto& worker = streams_.at(*it);
    if (worker->done(worker->last_enqueued())) it = busy_.erase(it);
    else ++it;
  }
}

std::uint64_t StreamSet::hold(stream_t stream, const char* entry) {
  auto gate = std::make_shared<Gate>();
  std::lock_guard<std::mutex> lock(mutex_);
  auto worker = stream_locked(stream, entry);
  enqueue_locked(stream, worker, [gate] { gate->wait(); }, {});
  const std::uint64_t id = next_hold_++;
  holds_.emplace(id, std::move(gate));
  return id;
}

void StreamSet::release_hold(std::uint64_t hold, const char* entry) {
  std::shared_ptr<Gate> gate;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = holds_.find(hold);
    if (it == holds_.end()) invalid(entry, "hold", hold);
    gate = std::move(it->second);
    holds_.erase(it);
  }
  gate->release();
}

std::size_t StreamSet::streams() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_.size() - 1;
}

std::size_t StreamSet::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

void StreamSet::record_fault(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fault_.empty()) fault_ = message;  // the first fault is the informative one
}

void StreamSet::report_fault(const char* entry) {
  std::string fault;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fault.swap(fault_);
  }
  if (!fault.empty())
    throw DeviceError(std::string(entry) + " on " + device_name_ +
                          ": queued work faulted: " + fault,
                      entry, cu_result::illegal_address);
}

}  // namespace vmalloc::detail
