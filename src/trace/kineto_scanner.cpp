// The Kineto JSON scanner: see include/vmalloc/trace/kineto_scanner.hpp. It mirrors
// vmalloc/traces/kineto.py and _json_stream.py; where they could differ it bails out instead.
#include "vmalloc/trace/kineto_scanner.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "vmalloc/trace/detail/utf8.hpp"

namespace vmalloc::trace_parse {

using detail::make_event;

// A JSON value of an event as found: its kind and text (a string's without the quotes).
struct KinetoScanner::Field {
  enum Kind { none, integer, floating, string, object, other, boolean } kind = none;
  const char* b = nullptr;
  const char* e = nullptr;
  bool escaped = false;
};
using Field = KinetoScanner::Field;

// The members of an event the reader looks at (the last of a repeated key wins).
struct KinetoScanner::EventFields {
  Field name, args, ts;
  Field type, id, addr, bytes, allocated, reserved;  // args' members
};
namespace {

// The largest trace event taken here (_json_stream refuses events of 16 Mi characters).
constexpr std::size_t max_json_event = 15u << 20;
constexpr int max_depth = 200;  // Python's decoder stops at its recursion limit


enum State { s_start, s_obj_first, s_obj_member, s_obj_after, s_arr_first, s_arr_elem,
             s_arr_after, s_end };

// String bytes that need a closer look: the quote, the backslash, control characters and
// non-ASCII (validated as UTF-8 as Python's strict decoder does).
struct JsonTable {
  bool special[256];
  JsonTable() {
    for (int c = 0; c < 256; ++c) special[c] = c == '"' || c == '\\' || c < 0x20 || c >= 0x80;
  }
};
const JsonTable json_table;

// A string's raw text (between the quotes) compared with an ASCII word; escapes are decoded
// (a \u escape beyond ASCII never equals an ASCII word).
bool string_is_escaped(const char* b, const char* e, const char* word, std::size_t len) {
  std::size_t i = 0;
  while (b < e) {
    char c = *b++;
    if (c == '\\') {
      char x = *b++;
      switch (x) {
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'n': c = '\n'; break;
        case 'r': c = '\r'; break;
        case 't': c = '\t'; break;
        case 'u': {
          unsigned v = 0;
          for (int k = 0; k < 4; ++k) v = v * 16 + static_cast<unsigned>(detail::hex_digit(static_cast<unsigned char>(*b++)));
          if (v >= 0x80) return false;
          c = static_cast<char>(v);
          break;
        }
        default: c = x;  // " \ /
      }
    }
    if (i >= len || word[i] != c) return false;
    ++i;
  }
  return i == len;
}

inline __attribute__((always_inline)) bool string_is(const char* b, const char* e, bool escaped,
                                                      const char* word, std::size_t len) {
  if (!escaped) return static_cast<std::size_t>(e - b) == len && std::memcmp(b, word, len) == 0;
  return string_is_escaped(b, e, word, len);
}

// Decimal digits as uint64; false if the value does not fit. Up to 19 digits always fit, so
// only longer tokens pay for the overflow checks.
inline bool digits_u64(const char* b, const char* e, std::uint64_t& out) {
  std::uint64_t v = 0;
  if (e - b <= 19) {
    for (; b < e; ++b) v = v * 10 + static_cast<unsigned>(static_cast<unsigned char>(*b) - '0');
    out = v;
    return true;
  }
  for (; b < e; ++b) {
    unsigned d = static_cast<unsigned char>(*b) - '0';
    if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, d, &v)) return false;
  }
  out = v;
  return true;
}

// A JSON integer token as int64; false if it does not fit.
bool token_int64(const char* b, const char* e, std::int64_t& out) {
  bool neg = *b == '-';
  if (neg) ++b;
  std::uint64_t v;
  if (!digits_u64(b, e, v)) return false;
  if (neg) {
    if (v > (1ull << 63)) return false;
    out = static_cast<std::int64_t>(0 - v);
  } else {
    if (v > static_cast<std::uint64_t>(INT64_MAX)) return false;
    out = static_cast<std::int64_t>(v);
  }
  return true;
}

// A JSON integer token as sign and magnitude; false if the magnitude exceeds 2**64 - 1.
bool token_magnitude(const char* b, const char* e, bool& neg, std::uint64_t& mag) {
  neg = *b == '-';
  if (neg) ++b;
  return digits_u64(b, e, mag);
}

// A value's kind and span, as found in an event.

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
    const char* q = ts.b;
    bool neg = *q == '-';
    if (neg) ++q;
    std::int64_t v = 0;
    for (; q < ts.e; ++q) v = v * 10 + (*q - '0');
    t = neg ? -static_cast<double>(v) : static_cast<double>(v);
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

// The scanners' cursor, a local copy written back at every return: through the caller's
// reference the compiler must store it before each byte read (a char may alias it).
struct Cursor {
  std::size_t& out;
  std::size_t p;
  explicit Cursor(std::size_t& o) : out(o), p(o) {}
  ~Cursor() { out = p; }
  Cursor(const Cursor&) = delete;
  Cursor& operator=(const Cursor&) = delete;
};

}  // namespace

KinetoScanner::KinetoScanner(std::int64_t want_type, std::int64_t want_id)
    : want_type_(want_type), want_id_(want_id) {}

KinetoScanner::R KinetoScanner::ws(std::size_t& pos) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  const char* d = d_;
  std::size_t n = n_;
  while (p < n) {
    char c = d[p];
    if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return R::ok;
    ++p;
  }
  return eof_ ? R::bail : R::more;
}

// Inline: most strings of a trace are short keys and names without escapes.
inline KinetoScanner::R KinetoScanner::string(std::size_t& p, bool& escaped) {
#if defined(__SSE2__)
  // A plain string that ends within the next sixteen bytes: the first special byte (a quote,
  // a backslash, a control byte or non-ASCII; a signed "< 0x20" takes the bytes >= 0x80, which
  // are negative) is its closing quote.
  const char* d = d_;
  if (p + 17 <= n_) {
    __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + p + 1));
    __m128i hit = _mm_or_si128(
        _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('"')), _mm_cmpeq_epi8(x, _mm_set1_epi8('\\'))),
        _mm_cmplt_epi8(x, _mm_set1_epi8(0x20)));
    unsigned m = static_cast<unsigned>(_mm_movemask_epi8(hit));
    if (m != 0) {
      std::size_t q = p + 1 + static_cast<std::size_t>(__builtin_ctz(m));
      if (d[q] == '"') {
        escaped = false;
        p = q + 1;
        return R::ok;
      }
    }
  }
#endif
  return string_rest(p, escaped);
}

KinetoScanner::R KinetoScanner::string_rest(std::size_t& pos, bool& escaped) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  // p at the opening quote; leaves p after the closing one.
  const unsigned char* d = reinterpret_cast<const unsigned char*>(d_);
  std::size_t n = n_;
  escaped = false;
  ++p;
  for (;;) {
    // Eight bytes at a time while none is special (a quote, a backslash, a control byte or
    // non-ASCII), then byte by byte.
    constexpr std::uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    while (p + 8 <= n) {
      std::uint64_t x;
      std::memcpy(&x, d + p, 8);
      std::uint64_t q = x ^ (ones * '"'), b = x ^ (ones * '\\');
      std::uint64_t hit = ((q - ones) & ~q) | ((b - ones) & ~b) | (x - ones * 0x20) | x;
      if (hit & highs) break;
      p += 8;
    }
    while (p < n && !json_table.special[d[p]]) ++p;
    if (p >= n) return eof_ ? R::bail : R::more;
    unsigned char c = d[p];
    if (c == '"') {
      ++p;
      return R::ok;
    }
    if (c == '\\') {
      escaped = true;
      if (p + 1 >= n) return eof_ ? R::bail : R::more;
      unsigned char x = d[p + 1];
      if (x == 'u') {
        if (p + 6 > n) return eof_ ? R::bail : R::more;
        for (int k = 2; k < 6; ++k)
          if (detail::hex_digit(d[p + k]) < 0) return R::bail;
        p += 6;
      } else if (x == '"' || x == '\\' || x == '/' || x == 'b' || x == 'f' || x == 'n' ||
                 x == 'r' || x == 't') {
        p += 2;
      } else {
        return R::bail;
      }
      continue;
    }
    if (c < 0x20) return R::bail;  // strict: no raw control characters
    // UTF-8, as Python's strict decoder: no overlongs, surrogates or code points > U+10FFFF.
    std::size_t len;
    switch (detail::utf8_sequence(d + p, n - p, /*surrogates=*/false, len)) {
      case detail::Utf8::invalid: return R::bail;
      case detail::Utf8::cut: return eof_ ? R::bail : R::more;
      case detail::Utf8::ok: break;
    }
    p += len;
  }
}

KinetoScanner::R KinetoScanner::number(std::size_t& pos, bool& integer) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)? ; a token that reaches the end of the buffer
  // may go on in the next block.
  const char* d = d_;
  std::size_t n = n_;
  std::size_t start = p;
  integer = true;
  auto more = [&]() { return eof_ ? R::bail : R::more; };
  if (d[p] == '-') {
    ++p;
    if (p >= n) return more();
  }
  if (d[p] == '0') {
    ++p;
  } else if (d[p] >= '1' && d[p] <= '9') {
    while (p < n && d[p] >= '0' && d[p] <= '9') ++p;
  } else {
    return R::bail;  // -Infinity and such: rare, the Python reader takes them
  }
  if (p >= n) return more();
  if (d[p] == '.') {
    integer = false;
    ++p;
    std::size_t digits = p;
    while (p < n && d[p] >= '0' && d[p] <= '9') ++p;
    if (p >= n) return more();
    if (p == digits) return R::bail;
  }
  if (d[p] == 'e' || d[p] == 'E') {
    integer = false;
    ++p;
    if (p >= n) return more();
    if (d[p] == '+' || d[p] == '-') ++p;
    std::size_t digits = p;
    while (p < n && d[p] >= '0' && d[p] <= '9') ++p;
    if (p >= n) return more();
    if (p == digits) return R::bail;
  }
  if (p - start > 1000) return R::bail;  // Python's int() has a digit limit
  return R::ok;
}

KinetoScanner::R KinetoScanner::literal(std::size_t& p, const char* word, std::size_t len) {
  std::size_t n = n_;
  std::size_t have = std::min(len, n - p);
  if (std::memcmp(d_ + p, word, have) != 0) return R::bail;
  if (have < len) return eof_ ? R::bail : R::more;
  p += len;
  return R::ok;
}

KinetoScanner::R KinetoScanner::value(std::size_t& pos, int depth) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  char c = d_[p];
  switch (c) {
    case '"': {
      bool escaped;
      return string(p, escaped);
    }
    case '{':
    case '[': {
      if (depth >= max_depth) return R::bail;
      char close = c == '{' ? '}' : ']';
      ++p;
      R r = ws(p);
      if (r != R::ok) return r;
      if (d_[p] == close) {
        ++p;
        return R::ok;
      }
      for (;;) {
        if (c == '{') {
          if (d_[p] != '"') return R::bail;
          bool escaped;
          if ((r = string(p, escaped)) != R::ok) return r;
          if ((r = ws(p)) != R::ok) return r;
          if (d_[p] != ':') return R::bail;
          ++p;
          if ((r = ws(p)) != R::ok) return r;
        }
        if ((r = value(p, depth + 1)) != R::ok) return r;
        if ((r = ws(p)) != R::ok) return r;
        char x = d_[p++];
        if (x == close) return R::ok;
        if (x != ',') return R::bail;
        if ((r = ws(p)) != R::ok) return r;
      }
    }
    case 't': return literal(p, "true", 4);
    case 'f': return literal(p, "false", 5);
    case 'n': return literal(p, "null", 4);
    default: {
      bool integer;
      return number(p, integer);
    }
  }
}

// One element of the events array: validated whole, its memory record appended if it is one.
// One member's value, its text and kind kept in `f`.
inline __attribute__((always_inline)) KinetoScanner::R KinetoScanner::field(std::size_t& q,
                                                                          Field& f, int depth) {
  f.b = d_ + q;
  const char c = d_[q];
  R r;
  bool integer = false;
  if (c == '"') {
    r = string(q, f.escaped);
    f.kind = Field::string;
    f.b += 1;
    f.e = d_ + q - 1;
    return r;
  }
  if (c == '-' || (c >= '0' && c <= '9')) {
    r = number(q, integer);
    f.kind = integer ? Field::integer : Field::floating;
  } else if (c == 't' || c == 'f') {
    r = value(q, depth);
    f.kind = Field::boolean;
  } else {
    r = value(q, depth);
    f.kind = c == '{' ? Field::object : Field::other;
  }
  f.e = d_ + q;
  return r;
}

// The members of an "args" object, at its '{': the device and memory fields are kept.
inline __attribute__((always_inline)) KinetoScanner::R KinetoScanner::args_members(
    std::size_t& p, EventFields& ev) {
  ev.args = Field();
  ev.args.kind = Field::object;
  ev.type = ev.id = ev.addr = ev.bytes = ev.allocated = ev.reserved = Field();
  R r;
  ++p;
  if ((r = ws(p)) != R::ok) return r;
  if (d_[p] == '}') {
    ++p;
    return R::ok;
  }
  for (;;) {
    if (d_[p] != '"') return R::bail;
    std::size_t ab = p;
    bool aesc;
    if ((r = string(p, aesc)) != R::ok) return r;
    const char* a0 = d_ + ab + 1;
    const char* a1 = d_ + p - 1;
    if ((r = ws(p)) != R::ok) return r;
    if (d_[p] != ':') return R::bail;
    ++p;
    if ((r = ws(p)) != R::ok) return r;
    Field scratch;
    Field* f = &scratch;
    if (string_is(a0, a1, aesc, "Addr", 4)) f = &ev.addr;
    else if (string_is(a0, a1, aesc, "Bytes", 5)) f = &ev.bytes;
    else if (string_is(a0, a1, aesc, "Device Type", 11)) f = &ev.type;
    else if (string_is(a0, a1, aesc, "Device Id", 9)) f = &ev.id;
    else if (string_is(a0, a1, aesc, "Total Allocated", 15)) f = &ev.allocated;
    else if (string_is(a0, a1, aesc, "Total Reserved", 14)) f = &ev.reserved;
    if ((r = field(p, *f, 2)) != R::ok) return r;
    if ((r = ws(p)) != R::ok) return r;
    char x = d_[p++];
    if (x == '}') return R::ok;
    if (x != ',') return R::bail;
    if ((r = ws(p)) != R::ok) return r;
  }
}

// A trace event (at its '{'): its members parsed, then, for a memory event, what the scanner
// does with it (count_event or device_event).
KinetoScanner::R KinetoScanner::event(std::size_t& pos, Events& out) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  if (d_[p] != '{') return R::bail;  // "a trace event is not a JSON object"
  EventFields ev;
  ++p;
  R r = ws(p);
  if (r != R::ok) return r;
  if (d_[p] != '}') {
    for (;;) {
      if (d_[p] != '"') return R::bail;
      std::size_t kb = p;
      bool kesc;
      if ((r = string(p, kesc)) != R::ok) return r;
      const char* k0 = d_ + kb + 1;
      const char* k1 = d_ + p - 1;
      if ((r = ws(p)) != R::ok) return r;
      if (d_[p] != ':') return R::bail;
      ++p;
      if ((r = ws(p)) != R::ok) return r;
      if (string_is(k0, k1, kesc, "name", 4)) {
        r = field(p, ev.name, 1);
      } else if (string_is(k0, k1, kesc, "ts", 2)) {
        r = field(p, ev.ts, 1);
      } else if (string_is(k0, k1, kesc, "args", 4) && d_[p] == '{') {
        r = args_members(p, ev);
      } else if (string_is(k0, k1, kesc, "args", 4)) {
        ev.args = Field();
        r = field(p, ev.args, 1);
        ev.type = ev.id = ev.addr = ev.bytes = ev.allocated = ev.reserved = Field();
      } else {
        r = value(p, 1);
      }
      if (r != R::ok) return r;
      if ((r = ws(p)) != R::ok) return r;
      char x = d_[p++];
      if (x == '}') break;
      if (x != ',') return R::bail;
      if ((r = ws(p)) != R::ok) return r;
    }
  } else {
    ++p;
  }
  // The event is complete and valid: is it a memory event of the device?
  const Field& name = ev.name;
  if (name.kind != Field::string) return R::ok;
  if (!string_is(name.b, name.e, name.escaped, "[memory]", 8)) {
    if (string_is(name.b, name.e, name.escaped, "[OutOfMemory]", 13)) ++ooms;
    return R::ok;
  }
  if (ev.args.kind != Field::object) return R::bail;  // "[memory] event without an 'args' object"
  std::int64_t dtype, did = 0;
  if (ev.type.kind != Field::integer || !token_int64(ev.type.b, ev.type.e, dtype)) return R::bail;
  if (ev.id.kind != Field::none &&
      (ev.id.kind != Field::integer || !token_int64(ev.id.b, ev.id.e, did)))
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
  if (addr.kind != Field::integer || !token_magnitude(addr.b, addr.e, aneg, a) ||
      (aneg && a != 0) || bytes.kind != Field::integer ||
      !token_magnitude(bytes.b, bytes.e, neg, mag) ||
      (allocated.kind == Field::integer && !token_int64(allocated.b, allocated.e, total))) {
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
  if (tk < 0 || (ev.reserved.kind == Field::integer &&
                 !token_int64(ev.reserved.b, ev.reserved.e, total_reserved))) {
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
  if (addr.kind != Field::integer || !token_magnitude(addr.b, addr.e, neg, a)) return R::bail;
  if (neg && a != 0) return R::bail;  // "'Addr' must be an integer in [0, 2**64)"
  if (bytes.kind != Field::integer || !token_magnitude(bytes.b, bytes.e, neg, mag)) return R::bail;
  // PyTorch's counters: integers only (as type(...) is int); beyond int64 the Python reader.
  std::int64_t total_allocated = 0, total_reserved = 0;
  if (allocated.kind == Field::integer &&
      !token_int64(allocated.b, allocated.e, total_allocated))
    return R::bail;
  if (reserved.kind == Field::integer && !token_int64(reserved.b, reserved.e, total_reserved))
    return R::bail;
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

std::size_t KinetoScanner::count_device(std::int64_t type, std::int64_t id) {
  for (std::size_t i = 0; i < devices.size(); ++i) {
    auto& d = devices[i];
    if (d.first.first == type && d.first.second == id) {
      ++d.second;
      return i;
    }
  }
  devices.push_back({{type, id}, 1});
  if (want_type_ == count_devices && scans_ok) device_scans.emplace_back();
  return devices.size() - 1;
}

void KinetoScanner::drop_kept() {
  kept_dropped = true;
  kept_bytes = 0;
  for (auto& d : device_scans) std::vector<Events>().swap(d.kept);
}

// A top-level member other than traceEvents, from its name: kept if its value is a scalar.
KinetoScanner::R KinetoScanner::member(std::size_t& pos) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  if (d_[p] != '"') return R::bail;
  std::size_t kb = p;
  bool kesc;
  R r = string(p, kesc);
  if (r != R::ok) return r;
  std::size_t ke = p;
  if (kesc) return R::bail;
  if ((r = ws(p)) != R::ok) return r;
  if (d_[p] != ':') return R::bail;
  ++p;
  if ((r = ws(p)) != R::ok) return r;
  if (ke - kb == 13 && std::memcmp(d_ + kb, "\"traceEvents\"", 13) == 0) {
    if (d_[p] != '[') return R::bail;
    ++p;
    found_events_ = true;
    state_ = s_arr_first;
    in_object_ = true;
    return R::ok;
  }
  std::size_t vb = p;
  char c = d_[p];
  if ((r = value(p, 1)) != R::ok) return r;
  if (c != '{' && c != '[')
    metadata.emplace_back(std::string(d_ + kb, ke - kb), std::string(d_ + vb, p - vb));
  state_ = s_obj_after;
  return R::ok;
}

KinetoScanner::R KinetoScanner::run(Events& out) {
  for (;;) {
    std::size_t p = pos_;
    R r = ws(p);
    if (r == R::bail && state_ == s_end) return R::ok;  // whitespace to the end of the file
    if (r != R::ok) return r;
    char c = d_[p];
    switch (state_) {
      case s_start:
        if (c == '{') state_ = s_obj_first;
        else if (c == '[') state_ = s_arr_first;
        else return R::bail;
        ++p;
        break;
      case s_obj_first:
        if (c == '}') {
          ++p;
          state_ = s_end;
        } else {
          state_ = s_obj_member;
        }
        break;
      case s_obj_member:
        r = member(p);
        if (r == R::more && n_ - pos_ > max_json_event) return R::bail;
        if (r != R::ok) return r;
        break;
      case s_obj_after:
        ++p;
        if (c == ',') state_ = s_obj_member;
        else if (c == '}') state_ = s_end;
        else return R::bail;
        break;
      case s_arr_first:
        if (c == ']') {
          ++p;
          state_ = in_object_ ? s_obj_after : s_end;
        } else {
          state_ = s_arr_elem;
        }
        break;
      case s_arr_elem: {
        std::size_t before = out.size();
        r = event(p, out);
        if (r == R::more) out.resize(before);
        if (r == R::more && n_ - pos_ > max_json_event) return R::bail;
        if (r != R::ok) return r;
        state_ = s_arr_after;
        break;
      }
      case s_arr_after:
        ++p;
        if (c == ',') state_ = s_arr_elem;
        else if (c == ']') state_ = in_object_ ? s_obj_after : s_end;
        else return R::bail;
        break;
      case s_end:
        return R::bail;  // "unexpected data after the trace"
    }
    pos_ = p;
  }
}

bool KinetoScanner::feed(const char* data, std::size_t n, Events& out) {
  // An event cut by the end of the block is parsed again, whole, once the next block has
  // its end: event() counts and appends only once an event is complete, so nothing is
  // counted twice. Only that event's bytes are copied (buf_); the rest of the block is
  // parsed where the caller holds it.
  std::size_t from = 0;  // where in data the direct parse starts
  if (!buf_.empty()) {
    std::size_t carry = n_;  // pos_ == 0: feed() keeps only the unparsed tail
    std::size_t take = std::min(n, stitch_bytes);
    buf_.append(data, take);
    view(buf_);
    if (run(out) == R::bail) return false;
    if (pos_ < carry && take < n) {  // a longer event: the whole block, as it needs
      buf_.append(data + take, n - take);
      view(buf_);
      if (run(out) == R::bail) return false;
    }
    if (pos_ < carry) {  // still cut: all of the block is in buf_
      buf_.erase(0, pos_);
      pos_ = 0;
      return true;
    }
    from = pos_ - carry;
    buf_.clear();
  }
  d_ = data;
  n_ = n;
  pos_ = from;
  if (run(out) == R::bail) return false;
  buf_.assign(data + pos_, n - pos_);
  pos_ = 0;
  view(buf_);  // data is the caller's only until this returns
  return true;
}

bool KinetoScanner::finish(Events& out) {
  eof_ = true;
  view(buf_);
  if (run(out) != R::ok) return false;
  for (auto& d : device_scans) {
    d.scan.feed(d.pending.data(), d.pending.size());
    Events().swap(d.pending);
  }
  if (state_ != s_end) return false;
  if (devices.empty()) return false;  // the Python reader words the error
  if (matched == 0 && want_type_ != count_devices) return false;
  return true;
}

}  // namespace vmalloc::trace_parse
