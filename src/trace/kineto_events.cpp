// The Kineto scanner's trace events: an element of "traceEvents" parsed and validated whole,
// the members the reader looks at kept, and a memory event counted (device count) or
// appended as a raw record (a device's pass). It mirrors vmalloc/traces/kineto.py; where they
// could differ it bails out. The streaming driver is kineto_scanner.cpp, the tokens
// detail/json_tokens.hpp.
#include <cstdlib>
#include <cstring>

#include "vmalloc/trace/kineto_scanner.hpp"

namespace vmalloc::trace_parse {

using detail::JsonNumber;
using detail::make_event;
using detail::string_is;

// A JSON value of an event as found: its kind and text (a string's without the quotes), and
// for a number its scan (an integer's value, where exact).
// Only `kind` is initialized: the rest is read only for a kind that sets it (an event resets
// ten of these).
struct KinetoScanner::Field {
  enum Kind { none, integer, floating, string, object, other, boolean } kind = none;
  const char* b;
  const char* e;
  bool escaped;
  JsonNumber num;
};
using Field = KinetoScanner::Field;

// The members of an event the reader looks at (the last of a repeated key wins).
struct KinetoScanner::EventFields {
  Field name, args, ts;
  Field type, id, addr, bytes, allocated, reserved;  // args' members
  void clear_args() {  // a repeated "args" replaces the members found before
    type.kind = id.kind = addr.kind = bytes.kind = allocated.kind = reserved.kind = Field::none;
  }
};

namespace {

// An integer field as sign and magnitude; false if the magnitude exceeds 2**64 - 1.
inline bool field_magnitude(const Field& f, bool& neg, std::uint64_t& mag) {
  neg = f.num.neg;
  if (f.num.exact) {
    mag = f.num.mag;
    return true;
  }
  return detail::digits_u64(f.b + (neg ? 1 : 0), f.e, mag);
}

// An integer field as int64; false if it does not fit.
inline bool field_int64(const Field& f, std::int64_t& out) {
  bool neg;
  std::uint64_t v;
  if (!field_magnitude(f, neg, v)) return false;
  if (neg) {
    if (v > (1ull << 63)) return false;
    out = static_cast<std::int64_t>(0 - v);
  } else {
    if (v > static_cast<std::uint64_t>(INT64_MAX)) return false;
    out = static_cast<std::int64_t>(v);
  }
  return true;
}

// An event's "ts" as a double: 1 (t set), 0 (no numeric ts), -1 (the device's pass bails).
int ts_value(const Field& ts, double& t) {
  if (ts.kind != Field::integer && ts.kind != Field::floating && ts.kind != Field::boolean)
    return 0;
  if (ts.kind == Field::boolean) {
    t = *ts.b == 't' ? 1.0 : 0.0;
    return 1;
  }
  if (ts.kind == Field::integer && ts.e - ts.b > 15) return -1;  // exact as a double
  if (ts.kind == Field::integer) {  // at most 15 characters: exact in a double, as strtod
    const double v = static_cast<double>(ts.num.mag);
    t = ts.num.neg ? -v : v;
    return 1;
  }
  char tmp[1024];
  std::size_t len = static_cast<std::size_t>(ts.e - ts.b);
  if (len >= sizeof tmp) return -1;
  std::memcpy(tmp, ts.b, len);
  tmp[len] = 0;
  t = std::strtod(tmp, nullptr);
  return 1;
}

// The event members the reader looks at, by key; the names' lengths differ, so one length
// test and one compare decide a plain key.
enum class Key { other, name, ts, args };

inline Key event_key(const char* b, const char* e, bool escaped) {
  if (escaped) {
    if (string_is(b, e, true, "name", 4)) return Key::name;
    if (string_is(b, e, true, "ts", 2)) return Key::ts;
    if (string_is(b, e, true, "args", 4)) return Key::args;
    return Key::other;
  }
  switch (e - b) {
    case 2: return std::memcmp(b, "ts", 2) == 0 ? Key::ts : Key::other;
    case 4:
      if (std::memcmp(b, "name", 4) == 0) return Key::name;
      return std::memcmp(b, "args", 4) == 0 ? Key::args : Key::other;
    default: return Key::other;
  }
}

// The member of "args" kept for the key, or nullptr.
inline Field* args_key(KinetoScanner::EventFields& ev, const char* b, const char* e,
                       bool escaped) {
  if (escaped) {
    if (string_is(b, e, true, "Addr", 4)) return &ev.addr;
    if (string_is(b, e, true, "Bytes", 5)) return &ev.bytes;
    if (string_is(b, e, true, "Device Type", 11)) return &ev.type;
    if (string_is(b, e, true, "Device Id", 9)) return &ev.id;
    if (string_is(b, e, true, "Total Allocated", 15)) return &ev.allocated;
    if (string_is(b, e, true, "Total Reserved", 14)) return &ev.reserved;
    return nullptr;
  }
  switch (e - b) {
    case 4: return std::memcmp(b, "Addr", 4) == 0 ? &ev.addr : nullptr;
    case 5: return std::memcmp(b, "Bytes", 5) == 0 ? &ev.bytes : nullptr;
    case 11: return std::memcmp(b, "Device Type", 11) == 0 ? &ev.type : nullptr;
    case 9: return std::memcmp(b, "Device Id", 9) == 0 ? &ev.id : nullptr;
    case 15: return std::memcmp(b, "Total Allocated", 15) == 0 ? &ev.allocated : nullptr;
    case 14: return std::memcmp(b, "Total Reserved", 14) == 0 ? &ev.reserved : nullptr;
    default: return nullptr;
  }
}

}  // namespace

// One member's value, its text and kind kept in `f`.
inline __attribute__((always_inline)) KinetoScanner::R KinetoScanner::field(std::size_t& q,
                                                                          Field& f, int depth) {
  const char* d = t_.d;
  f.b = d + q;
  const char c = d[q];
  R r;
  if (c == '"') {
    r = t_.string(q, f.escaped);
    f.kind = Field::string;
    f.b += 1;
    f.e = d + q - 1;
    return r;
  }
  if (c == '-' || static_cast<unsigned char>(c - '0') < 10) {
    r = t_.number(q, f.num);
    f.kind = f.num.integer ? Field::integer : Field::floating;
  } else if (c == 't' || c == 'f') {
    r = t_.skip(q, depth);
    f.kind = Field::boolean;
  } else {
    r = t_.skip(q, depth);
    f.kind = c == '{' ? Field::object : Field::other;
  }
  f.e = d + q;
  return r;
}

// The members of an "args" object, at its '{': the device and memory fields are kept.
inline __attribute__((always_inline)) KinetoScanner::R KinetoScanner::args_members(
    std::size_t& p, EventFields& ev) {
  ev.args.kind = Field::object;
  ev.clear_args();
  const char* d = t_.d;
  R r;
  ++p;
  if ((r = t_.ws(p)) != R::ok) return r;
  if (d[p] == '}') {
    ++p;
    return R::ok;
  }
  for (;;) {
    if (d[p] != '"') return R::bail;
    std::size_t ab = p;
    bool aesc;
    if ((r = t_.string(p, aesc)) != R::ok) return r;
    Field* f = args_key(ev, d + ab + 1, d + p - 1, aesc);
    if ((r = t_.ws(p)) != R::ok) return r;
    if (d[p] != ':') return R::bail;
    ++p;
    if ((r = t_.ws(p)) != R::ok) return r;
    Field scratch;
    if ((r = field(p, f ? *f : scratch, 2)) != R::ok) return r;
    if ((r = t_.ws(p)) != R::ok) return r;
    char x = d[p++];
    if (x == '}') return R::ok;
    if (x != ',') return R::bail;
    if ((r = t_.ws(p)) != R::ok) return r;
  }
}

// A trace event (at its '{'): its members parsed, then, for a memory event, what the scanner
// does with it (count_event or device_event).
KinetoScanner::R KinetoScanner::event(std::size_t& pos, Events& out) {
  std::size_t p = pos;  // a local cursor: see JsonText::string_rest
  const char* d = t_.d;
  if (d[p] != '{') return R::bail;  // "a trace event is not a JSON object"
  EventFields ev;
  ++p;
  R r = t_.ws(p);
  if (r != R::ok) return r;
  if (d[p] != '}') {
    for (;;) {
      if (d[p] != '"') return R::bail;
      std::size_t kb = p;
      bool kesc;
      if ((r = t_.string(p, kesc)) != R::ok) return r;
      const Key key = event_key(d + kb + 1, d + p - 1, kesc);
      if ((r = t_.ws(p)) != R::ok) return r;
      if (d[p] != ':') return R::bail;
      ++p;
      if ((r = t_.ws(p)) != R::ok) return r;
      if (key == Key::name) {
        r = field(p, ev.name, 1);
      } else if (key == Key::ts) {
        r = field(p, ev.ts, 1);
      } else if (key == Key::args && d[p] == '{') {
        r = args_members(p, ev);
      } else if (key == Key::args) {
        r = field(p, ev.args, 1);
        ev.clear_args();
      } else {
        r = t_.value(p, 1);
      }
      if (r != R::ok) return r;
      if ((r = t_.ws(p)) != R::ok) return r;
      char x = d[p++];
      if (x == '}') break;
      if (x != ',') return R::bail;
      if ((r = t_.ws(p)) != R::ok) return r;
    }
  } else {
    ++p;
  }
  pos = p;
  // The event is complete and valid: is it a memory event of the device?
  const Field& name = ev.name;
  if (name.kind != Field::string) return R::ok;
  if (!string_is(name.b, name.e, name.escaped, "[memory]", 8)) {
    if (string_is(name.b, name.e, name.escaped, "[OutOfMemory]", 13)) ++ooms;
    return R::ok;
  }
  if (ev.args.kind != Field::object) return R::bail;  // "[memory] event without an 'args' object"
  std::int64_t dtype, did = 0;
  if (ev.type.kind != Field::integer || !field_int64(ev.type, dtype)) return R::bail;
  if (ev.id.kind != Field::none && (ev.id.kind != Field::integer || !field_int64(ev.id, did)))
    return R::bail;
  std::size_t slot = count_device(dtype, did);
  if (want_type_ == count_devices) {
    if (scans_ok) count_event(ev, device_scans[slot]);
    return R::ok;
  }
  if (dtype != want_type_ || (want_id_ >= 0 && did != want_id_)) return R::ok;
  return device_event(ev, out);
}

// The device count's handling of a memory event of device `d`: its live scan, and the event
// kept (with the counters of the device's own pass) for that pass.
void KinetoScanner::count_event(const EventFields& ev, DeviceScan& d) {
  std::uint64_t a, mag;
  bool aneg, neg;
  std::int64_t total = 0;
  const Field &addr = ev.addr, &bytes = ev.bytes, &allocated = ev.allocated;
  if (addr.kind != Field::integer || !field_magnitude(addr, aneg, a) || (aneg && a != 0) ||
      bytes.kind != Field::integer || !field_magnitude(bytes, neg, mag) ||
      (allocated.kind == Field::integer && !field_int64(allocated, total))) {
    scans_ok = false;
    drop_kept();
    device_scans.clear();
    return;
  }
  if (allocated.kind == Field::integer && !d.have_allocated) {
    d.have_allocated = true;
    d.first_allocated = total;
    d.first_bytes_negative = neg;
    d.first_bytes = mag;
  }
  TraceEvent e = make_event(neg ? TraceEvent::op_free : TraceEvent::op_alloc, 0, a, mag);
  if (mag != 0) {
    // Batched, so that the scan's table probes overlap (finish() feeds the rest).
    d.pending.push_back(e);
    if (d.pending.size() == scan_batch) {
      d.scan.feed(d.pending.data(), d.pending.size());
      d.pending.clear();
    }
  }
  if (keep_limit == 0 || kept_dropped) return;
  // What the device's own pass does with the event (the checks above are its own too).
  std::int64_t total_reserved = 0;
  double t = 0;
  int tk = ts_value(ev.ts, t);
  if (tk < 0 || (ev.reserved.kind == Field::integer && !field_int64(ev.reserved, total_reserved))) {
    drop_kept();
    return;
  }
  if (tk > 0) {
    if (d.have_ts && t < d.last_ts) ++d.out_of_order;
    d.last_ts = t;
    d.have_ts = true;
  }
  ++d.matched;
  if (allocated.kind == Field::integer) {
    if (!d.have_peak_allocated || total > d.peak_allocated) d.peak_allocated = total;
    d.have_peak_allocated = true;
  }
  if (ev.reserved.kind == Field::integer &&
      (!d.have_reserved || total_reserved > d.peak_reserved)) {
    d.peak_reserved = total_reserved;
    d.have_reserved = true;
  }
  if (mag == 0) {
    ++d.zero_bytes;
    return;
  }
  if (d.kept.empty() || d.kept.back().size() == kept_chunk) {
    if (kept_bytes + kept_chunk * sizeof(TraceEvent) > keep_limit) {
      drop_kept();
      return;
    }
    d.kept.emplace_back();
    d.kept.back().reserve(kept_chunk);
    kept_bytes += kept_chunk * sizeof(TraceEvent);
  }
  d.kept.back().push_back(e);
}

// A memory event of the device read: its raw record and the pass's counters.
KinetoScanner::R KinetoScanner::device_event(const EventFields& ev, Events& out) {
  const Field &addr = ev.addr, &bytes = ev.bytes, &allocated = ev.allocated,
              &reserved = ev.reserved;
  std::uint64_t a, mag;
  bool neg;
  if (addr.kind != Field::integer || !field_magnitude(addr, neg, a)) return R::bail;
  if (neg && a != 0) return R::bail;  // "'Addr' must be an integer in [0, 2**64)"
  if (bytes.kind != Field::integer || !field_magnitude(bytes, neg, mag)) return R::bail;
  // PyTorch's counters: integers only (as type(...) is int); beyond int64 the Python reader.
  std::int64_t total_allocated = 0, total_reserved = 0;
  if (allocated.kind == Field::integer && !field_int64(allocated, total_allocated))
    return R::bail;
  if (reserved.kind == Field::integer && !field_int64(reserved, total_reserved)) return R::bail;
  double t = 0;
  int tk = ts_value(ev.ts, t);
  if (tk < 0) return R::bail;
  if (tk > 0) {
    if (have_ts_ && t < last_ts_) ++out_of_order;
    last_ts_ = t;
    have_ts_ = true;
  }
  ++matched;
  if (allocated.kind == Field::integer) {
    if (!have_allocated) {
      first_allocated = total_allocated;
      first_bytes_negative = neg;
      first_bytes = mag;
      peak_allocated = total_allocated;
      have_allocated = true;
    } else if (total_allocated > peak_allocated) {
      peak_allocated = total_allocated;
    }
  }
  if (reserved.kind == Field::integer && (!have_reserved || total_reserved > peak_reserved)) {
    peak_reserved = total_reserved;
    have_reserved = true;
  }
  if (mag == 0) {
    ++zero_bytes;
  } else {
    out.push_back(make_event(neg ? TraceEvent::op_free : TraceEvent::op_alloc, 0, a, mag));
  }
  return R::ok;
}

}  // namespace vmalloc::trace_parse
