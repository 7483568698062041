// Stream-ordered reuse of freed memory: what work may still touch a freed range or block, and
// how to make it safe for another stream or for unmapping.
//
// deallocate(ptr, n, stream) makes memory reusable at once on `stream`: later work there is
// ordered after the work that used it. Another stream, or cuMemUnmap, must wait for the work
// queued on the freeing stream before the free. PendingWork records that: the freeing stream
// and an event recorded at free time -- except while the default stream 0 is the only stream
// in use: then no event is recorded, so the single-stream cache-hit path makes no driver call
// at all, and a range freed that way gets its event recorded on stream 0 at the moment it is
// needed, which covers at least the free-time work. Only stream 0 may be used after the free
// like this: it can never be destroyed, while any other stream's owner may destroy it right
// after the free, and using a destroyed handle is undefined on a GPU.
//
// CU_STREAM_PER_THREAD (0x2) is a different stream on each host thread: the allocators key it
// with the calling thread (stream_key) so that two threads' per-thread streams are two
// streams here, and StreamOrder passes the handle 0x2 to the device only from that thread.
//
// Events come from a refcounted pool (split ranges share their event), so after warm-up no
// event is created. Not thread-safe: used under the allocator's mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "vmalloc/device/device.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

inline constexpr std::uint32_t no_event = 0xFFFFFFFFu;

inline constexpr stream_t cu_stream_legacy = 0x1;      // CU_STREAM_LEGACY
inline constexpr stream_t cu_stream_per_thread = 0x2;  // CU_STREAM_PER_THREAD
inline constexpr stream_t per_thread_key_tag = stream_t(1) << (sizeof(stream_t) * 8 - 1);

// A small number unique to the calling thread (never reused in the process).
std::uintptr_t stream_thread_index() noexcept;
// The identity of a stream argument: CU_STREAM_PER_THREAD keyed with the calling thread,
// every other handle itself.
inline stream_t stream_key(stream_t stream) noexcept {
  return stream == cu_stream_per_thread ? (per_thread_key_tag | stream_thread_index()) : stream;
}
// The handle to pass to the device for a stream key (valid for a per-thread key only on its
// own thread).
inline stream_t stream_handle_of(stream_t key) noexcept {
  return (key & per_thread_key_tag) != 0 ? cu_stream_per_thread : key;
}

// What may still be running on a freed range. `idle` means nothing: reusable by any stream and
// unmappable without waiting.
struct PendingWork {
  stream_t stream = 0;
  std::uint64_t seq = 0;           // free order: a later free on a stream covers earlier ones
  std::uint32_t event = no_event;  // index into the event pool, or no_event
  bool idle = true;
};

class StreamOrder {
 public:
  explicit StreamOrder(std::shared_ptr<Device> device) : device_(std::move(device)) {}
  ~StreamOrder();  // destroys the pooled events (errors swallowed: never throws)
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Notes a stream seen at allocate() (a stream key, see stream_key). Cheap: no driver call.
  void note_stream(stream_t stream) noexcept {
    if (!have_first_) {
      first_stream_ = stream;
      have_first_ = true;
    } else if (stream != first_stream_) {
      multi_stream_ = true;
    }
  }
  bool multi_stream() const noexcept { return multi_stream_; }

  // The work of a free on `stream` now. Records an event unless stream 0 is the only stream in
  // use (may throw DeviceError, e.g. an unknown stream, and then changes nothing).
  PendingWork on_free(stream_t stream) {
    if (stream == 0 && !multi_stream_ && have_first_ && first_stream_ == 0) {  // the common case
      PendingWork work;
      work.stream = stream;
      work.seq = ++seq_;
      work.idle = false;
      return work;
    }
    return on_free_slow(stream);
  }

  // Makes memory with pending work `work` safe for new work on `stream`: nothing if idle or
  // the same stream; idle if its event has completed; otherwise `stream` waits on the event
  // (no host blocking). Throws DeviceError on a failed call; `work` stays valid.
  void make_usable_on(PendingWork& work, stream_t stream) {
    if (!free_on(work, stream)) make_usable_on_slow(work, stream);
  }
  // True if `work` needs nothing before reuse on `stream` (no driver call).
  static bool free_on(const PendingWork& work, stream_t stream) noexcept {
    return work.idle || work.stream == stream;
  }
  // True if the event already completed (turns `work` idle); queries the device.
  bool completed(PendingWork& work);
  // Like completed(), but first records the event of work freed before a second stream
  // appeared (which has none), so that any free can be polled without blocking the host.
  // May throw DeviceError (then `work` is unchanged).
  bool poll(PendingWork& work) {
    if (work.idle) return true;
    if (!settle_or_record(work)) return true;  // its stream is gone: the device was synchronized
    return completed(work);
  }
  // Blocks the host until the work is done (before cuMemUnmap); `work` becomes idle.
  void synchronize(PendingWork& work);

  // Two pieces of free memory may merge if one is idle or both were freed on one stream.
  static bool can_merge(const PendingWork& a, const PendingWork& b) noexcept {
    return a.idle || b.idle || a.stream == b.stream;
  }
  // Merges `from` into `into` (can_merge true); consumes `from`.
  void merge_into(PendingWork& into, PendingWork& from) noexcept {
    if (from.idle) return;
    if (into.idle) {
      into = from;
      from = PendingWork{};
      return;
    }
    // Same stream: the later free's event captured everything queued before the earlier one.
    if (into.seq < from.seq) std::swap(into, from);
    drop(from);
  }
  // A second owner of `work` (a split): shares its event.
  PendingWork share(const PendingWork& work) noexcept {
    if (work.event != no_event) ++slots_[work.event].refs;
    return work;
  }
  // Gives up `work`'s event reference; `work` becomes idle.
  void drop(PendingWork& work) noexcept {
    if (work.event != no_event) unref(work.event);
    work = PendingWork{};
  }

  std::size_t events_created() const noexcept { return slots_.size(); }
  std::size_t events_in_use() const noexcept { return slots_.size() - free_slots_.size(); }

 private:
  struct Slot {
    event_t handle = 0;
    std::uint32_t refs = 0;
  };
  // Gives `work` an event if it has none (recorded on its freeing stream now); true if it has
  // one afterwards, false if it turned idle instead (its stream was destroyed: the device
  // was synchronized).
  bool settle_or_record(PendingWork& work);
  // A pooled event recorded on `stream` now, refcount 1. Throws DeviceError (pool unchanged).
  std::uint32_t record(stream_t stream);
  void unref(std::uint32_t index) noexcept {
    if (--slots_[index].refs == 0) free_slots_.push_back(index);  // capacity reserved
  }
  PendingWork on_free_slow(stream_t stream);
  void make_usable_on_slow(PendingWork& work, stream_t stream);

  std::shared_ptr<Device> device_;
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_slots_;
  std::uint64_t seq_ = 0;
  stream_t first_stream_ = 0;
  bool have_first_ = false;
  bool multi_stream_ = false;
  std::uint64_t synced_seq_ = 0;  // every free up to this seq was done at a device synchronize
};

}  // namespace vmalloc::detail
