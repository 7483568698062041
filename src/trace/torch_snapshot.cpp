// A PyTorch memory snapshot in C++: see include/vmalloc/trace/torch_snapshot.hpp. Every rule
// here is one of vmalloc/traces/torch_snapshot.py's; where that reader raises, this one
// returns false.
#include "vmalloc/trace/torch_snapshot.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "vmalloc/base/detail/flat_map.hpp"

namespace vmalloc::trace_parse {
namespace {

using V = PickleValue;

// `value` as the reader's u64(): an int (not a bool) in [0, 2**64).
inline bool as_u64(const V* value, std::uint64_t& out) {
  if (value == nullptr) return false;
  if (value->kind == V::big_unsigned ||
      (value->kind == V::integer && static_cast<std::int64_t>(value->v) >= 0)) {
    out = value->v;
    return true;
  }
  return false;
}

// entry.get(key, 0) as u64().
inline bool as_u64_or_zero(const V* value, std::uint64_t& out) {
  if (value == nullptr) {
    out = 0;
    return true;
  }
  return as_u64(value, out);
}

// A set of addresses with a byte each (one probe an entry on million-entry histories).
using AddressMap = vmalloc::detail::FlatMap<std::uint8_t>;

constexpr std::uint32_t a_alloc = 0, a_free_requested = 1, a_free_completed = 2;


}  // namespace

bool SnapshotHistory::build(PickleReader& pickle) {
  const V& root = pickle.root();
  if (root.kind != V::dict) return false;  // "the pickle holds a ..., not a dict"
  if (pickle.compact(root)) return false;  // a dict with an "action": not decided here
  const V* traces = pickle.find(root, w_device_traces);
  if (traces == nullptr || traces->kind != V::list) return false;
  // A list whose values were dropped (see PickleContainer) met where they matter: the Python
  // reader decides.
  bool ok = pickle.complete(*traces);
  // snapshot.get("segments") or []
  const V* segments = pickle.find(root, w_segments);
  if (segments != nullptr && pickle.truthy(*segments) && segments->kind != V::list) return false;

  entries_ = pickle.take_entries();
  // The row of an entry: a compact dict's own; for any other value a summary made here (a
  // dict whose "action" came after its first SETITEMS, or a value that is no dict: flags 0).
  auto row_of = [&](const V& e) -> std::uint64_t {
    if (pickle.compact(e)) return pickle.container(e).first;
    SnapshotEntry entry;
    entry.flags = 0;
    if (e.kind == V::dict) {
      const V* action = nullptr;
      const V* addr = nullptr;
      const V* size = nullptr;
      const V* stream = nullptr;
      pickle.each_item(e, [&](const V& key, const V& value) {  // the last value of a key wins
        if (key.kind != V::str) return;
        switch (key.word) {
          case w_action: action = &value; break;
          case w_addr: addr = &value; break;
          case w_size: size = &value; break;
          case w_stream: stream = &value; break;
          default: break;
        }
      });
      if (action != nullptr && action->kind == V::str) {
        entry.flags = SnapshotEntry::has_action;
        entry.action = pickle.action_id(*action);
        if (as_u64(addr, entry.addr)) entry.flags |= SnapshotEntry::addr_ok;
        if (as_u64_or_zero(size, entry.size)) entry.flags |= SnapshotEntry::size_ok;
        if (as_u64_or_zero(stream, entry.stream)) entry.flags |= SnapshotEntry::stream_ok;
      }
    }
    entries_.push_back(entry);
    return entries_.size() - 1;
  };
  // A list met again (the memo shares one list between several devices) shares the rows of
  // its first place: memory stays bounded by what the file decodes to, not by its references.
  std::unordered_map<std::uint64_t, std::size_t> seen;  // container -> its first device
  pickle.each(*traces, [&](const V& history) {
    Device device;
    if (history.kind == V::list) {
      auto [it, first_time] = seen.try_emplace(history.v, devices.size());
      if (!first_time) {
        devices.push_back(devices[it->second]);
        return;
      }
      if (!pickle.complete(history)) ok = false;
      device.is_list = true;
      device.length = pickle.container(history).count;
      // Direct when the entries are compact dicts made one after the other, as pickle writes
      // a fresh list of fresh dicts: no row numbers to keep.
      std::uint64_t i = 0;
      pickle.each(history, [&](const V& e) {
        if (!device.direct) return;
        if (!pickle.compact(e)) {
          device.direct = false;
        } else if (i++ == 0) {
          device.first = pickle.container(e).first;
        } else if (pickle.container(e).first != device.first + i - 1) {
          device.direct = false;
        }
      });
      if (!device.direct) {
        device.first = order_.size();
        pickle.each(history, [&](const V& e) { order_.push_back(row_of(e)); });
      }
    }
    devices.push_back(device);
  });

  if (segments != nullptr && segments->kind == V::list) {
    if (!pickle.complete(*segments)) ok = false;
    pickle.each(*segments, [&](const V& s) {
      Segment segment;
      segment.first_block = blocks_.size();
      if (s.kind == V::dict) {
        if (pickle.compact(s)) {
          ok = false;  // a dict with an "action" as a segment: not decided here
          return;
        }
        segment.is_dict = true;
        if (const V* device = pickle.find(s, w_device)) {
          // segment.get("device", index) != index: equal as Python compares numbers.
          segment.device_kind = Segment::device_never;
          if (device->kind == V::integer || device->kind == V::boolean) {
            segment.device_kind = Segment::device_int;
            segment.device = static_cast<std::int64_t>(device->v);
          } else if (device->kind == V::floating) {
            double d;
            std::memcpy(&d, &device->v, 8);
            if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.0e15) {
              segment.device_kind = Segment::device_int;
              segment.device = static_cast<std::int64_t>(d);
            }
          }
        }
        segment.stream_ok = as_u64_or_zero(pickle.find(s, w_stream), segment.stream);
        if (const V* total = pickle.find(s, w_total_size)) {  // type(size) is int
          if (total->kind == V::integer) {
            segment.total_kind = Segment::total_int;
            segment.total = static_cast<std::int64_t>(total->v);
          } else if (total->kind == V::big_unsigned) {
            segment.total_kind = Segment::total_int;
            segment.total = static_cast<__int128>(total->v);
          } else if (total->kind == V::big_integer) {
            segment.total_kind = Segment::total_big;
          }
        }
        const V* blocks = pickle.find(s, w_blocks);  // segment.get("blocks") or []
        if (blocks != nullptr && pickle.truthy(*blocks)) {
          segment.blocks = blocks->kind == V::list ? Segment::blocks_list : Segment::blocks_bad;
        }
        if (segment.blocks == Segment::blocks_list) {
          if (!pickle.complete(*blocks)) ok = false;
          pickle.each(*blocks, [&](const V& b) {
            if (b.kind != V::dict) return;
            if (pickle.compact(b)) {
              ok = false;
              return;
            }
            const V* state = pickle.find(b, w_state);
            if (state == nullptr || state->kind != V::str ||
                (state->word != w_active_allocated && state->word != w_active_pending_free &&
                 state->word != w_active_awaiting_free))
              return;
            Block block;
            block.addr_ok = as_u64(pickle.find(b, w_address), block.addr);
            // block.get("requested_size") or block.get("size", 0)
            const V* requested = pickle.find(b, w_requested_size);
            if (requested != nullptr && pickle.truthy(*requested)) {
              block.size_ok = as_u64(requested, block.size);
            } else {
              block.size_ok = as_u64_or_zero(pickle.find(b, w_size), block.size);
            }
            blocks_.push_back(block);
          });
        }
      }
      segment.live_blocks = blocks_.size() - segment.first_block;
      segments_.push_back(segment);
    });
  }
  actions = pickle.actions();
  return ok;
}

bool SnapshotHistory::select(std::size_t index, SnapshotDevice& out) const {
  if (index >= devices.size() || !devices[index].is_list) return false;
  const Device& d = devices[index];
  const std::size_t n = d.length;
  out = SnapshotDevice();
  out.index = index;
  out.entries = n;
  out.effective.assign((n + 63) / 64, 0);
  constexpr std::uint8_t sized = SnapshotEntry::size_ok | SnapshotEntry::stream_ok;

  // One pass, backwards: every entry a dict with a str action, an int addr where the action
  // is one of the three; the entries of each action and the first of them; and the
  // free_requested entries that act as the free (no free_completed of the address follows
  // before it is allocated again). The map holds the addresses with a free_completed ahead:
  // none until the scan meets one, so a history without them (skip_actions=
  // ["free_completed"]) never touches it.
  std::vector<std::uint64_t> counts(actions.size(), 0), first(actions.size(), 0);
  AddressMap completed_later(0);
  bool completions = false;
  for (std::size_t i = n; i-- > 0;) {
    const SnapshotEntry& e = entry(d, i);
    if (!(e.flags & SnapshotEntry::has_action)) return false;  // "is not a dict with an 'action'"
    ++counts[e.action];
    first[e.action] = i;
    if (e.action > a_free_completed) continue;
    if (!(e.flags & SnapshotEntry::addr_ok)) return false;  // "'addr' must be an integer ..."
    bool record = true;
    if (e.action == a_free_completed) {
      completed_later[e.addr] = 1;
      completions = true;
    } else if (e.action == a_alloc) {
      if (completions) {
        if (const std::uint8_t* later = completed_later.find(e.addr)) {
          if (*later) completed_later[e.addr] = 0;
        }
      }
    } else {  // free_requested: the free unless a completion of the address lies ahead
      const std::uint8_t* later = completions ? completed_later.find(e.addr) : nullptr;
      if (later != nullptr && *later) {
        completed_later[e.addr] = 0;
        record = false;
      } else {
        out.effective[i >> 6] |= std::uint64_t{1} << (i & 63);
      }
    }
    // A record's size and stream must be ints (entry.get(key, 0)).
    if (record && (e.flags & sized) != sized) return false;
    out.records += record;
  }
  std::vector<std::uint32_t> order;
  for (std::uint32_t a = 0; a < actions.size(); ++a)
    if (counts[a]) order.push_back(a);
  std::sort(order.begin(), order.end(),
            [&](std::uint32_t x, std::uint32_t y) { return first[x] < first[y]; });
  for (std::uint32_t a : order) {
    out.actions.emplace_back(a, counts[a]);
    if (a > a_free_completed) out.skipped.emplace_back(a, counts[a]);
  }

  // The segments of the device, and the blocks live in them (by address: the first place, the
  // last value, as the reader's dict keeps them).
  __int128 segment_bytes = 0;
  std::vector<TraceEvent>& live = out.live;
  std::unordered_map<std::uint64_t, std::size_t> position;
  for (const Segment& s : segments_) {
    if (!s.is_dict) return false;  // "segment N is not a dict"
    if (s.device_kind == Segment::device_never) continue;
    if (s.device_kind == Segment::device_int && s.device != static_cast<std::int64_t>(index))
      continue;
    ++out.segments;
    if (s.total_kind == Segment::total_big) return false;
    if (s.total_kind == Segment::total_int) segment_bytes += s.total;
    if (s.blocks == Segment::blocks_bad) return false;  // "'blocks' is not a list"
    for (std::uint64_t b = 0; b < s.live_blocks; ++b) {
      const Block& block = blocks_[s.first_block + b];
      if (!block.addr_ok || !block.size_ok || !s.stream_ok) return false;
      TraceEvent r;
      std::memset(&r, 0, sizeof r);
      r.op = TraceEvent::op_alloc;
      r.stream = s.stream;
      r.addr = block.addr;
      r.size = block.size;
      auto [it, inserted] = position.try_emplace(block.addr, live.size());
      if (inserted) live.push_back(r);
      else live[it->second] = r;
    }
  }
  if (segment_bytes < INT64_MIN || segment_bytes > INT64_MAX) return false;
  out.segment_bytes = static_cast<std::int64_t>(segment_bytes);

  // Live blocks the history never mentions (alloc, free_requested or free_completed).
  if (!live.empty()) {
    AddressMap mentioned(live.size());
    for (const TraceEvent& r : live) mentioned[r.addr] = 1;
    for (std::size_t i = 0; i < n; ++i) {
      const SnapshotEntry& e = entry(d, i);
      if (e.action > a_free_completed) continue;
      if (mentioned.find(e.addr) != nullptr) mentioned[e.addr] = 2;
    }
    unsigned __int128 bytes = 0;
    for (const TraceEvent& r : live) {
      if (mentioned[r.addr] == 2) continue;
      out.untouched.push_back(r);
      bytes += r.size;
    }
    if (bytes > UINT64_MAX) return false;
    out.untouched_bytes = static_cast<std::uint64_t>(bytes);
  }
  return true;
}

void SnapshotHistory::records(const SnapshotDevice& device, std::size_t first, std::size_t n,
                              std::vector<TraceEvent>& out) const {
  const Device& d = devices[device.index];
  if (first >= device.entries) return;
  std::size_t end = n < device.entries - first ? first + n : device.entries;
  TraceEvent r;
  std::memset(&r, 0, sizeof r);
  for (std::size_t i = first; i < end; ++i) {
    const SnapshotEntry& e = entry(d, i);
    if (e.action == a_alloc) {
      r.op = TraceEvent::op_alloc;
    } else if (e.action == a_free_completed ||
               (e.action == a_free_requested && ((device.effective[i >> 6] >> (i & 63)) & 1))) {
      r.op = TraceEvent::op_free;
    } else {
      continue;
    }
    r.stream = e.stream;
    r.addr = e.addr;
    r.size = e.size;
    out.push_back(r);
  }
}

}  // namespace vmalloc::trace_parse
