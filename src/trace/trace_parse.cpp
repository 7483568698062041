// Fast paths of the text trace readers: see include/vmalloc/trace/trace_parse.hpp. Every function
// here mirrors a Python reader; where the two could differ the C++ side bails out instead.
#include "vmalloc/trace/trace_parse.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "vmalloc/trace/detail/utf8.hpp"

namespace vmalloc::trace_parse {
namespace {

// The longest line of an RMM log taken here (csv's field limit is 131,072 characters).
constexpr std::size_t max_csv_line = 100000;
// The largest trace event taken here (_json_stream refuses events of 16 Mi characters).
constexpr std::size_t max_json_event = 15u << 20;
constexpr int max_depth = 200;  // Python's decoder stops at its recursion limit

// Bytes that make an RMM line "odd": control characters but tab, quotes, non-ASCII.
struct CsvTable {
  bool odd[256];
  CsvTable() {
    for (int c = 0; c < 256; ++c) odd[c] = (c < 0x20 && c != '\t') || c == '"' || c >= 0x80;
  }
};
const CsvTable csv_table;

inline void trim(const char*& b, const char*& e) {
  while (b < e && (*b == ' ' || *b == '\t')) ++b;
  while (e > b && (e[-1] == ' ' || e[-1] == '\t')) --e;
}

inline int hex_digit(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool eq_lower(const char* b, const char* e, const char* word) {
  std::size_t n = std::strlen(word);
  if (static_cast<std::size_t>(e - b) != n) return false;
  for (std::size_t i = 0; i < n; ++i) {
    char c = b[i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != word[i]) return false;
  }
  return true;
}

// rmm_csv._hex: [0x]hex digits (any number of leading zeros) up to 2**64 - 1, or a null word.
bool parse_hex(const char* b, const char* e, std::uint64_t& value) {
  trim(b, e);
  if (eq_lower(b, e, "(nil)") || eq_lower(b, e, "nil") || eq_lower(b, e, "null") ||
      eq_lower(b, e, "nullptr")) {
    value = 0;
    return true;
  }
  if (e - b >= 2 && b[0] == '0' && (b[1] == 'x' || b[1] == 'X')) b += 2;
  if (b == e) return false;
  std::uint64_t v = 0;
  int significant = 0;
  for (; b < e; ++b) {
    int d = hex_digit(static_cast<unsigned char>(*b));
    if (d < 0) return false;
    if (v == 0 && d == 0) continue;
    if (++significant > 16) return false;
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  value = v;
  return true;
}

// rmm_csv._size: decimal digits up to 2**64 - 1.
bool parse_decimal(const char* b, const char* e, std::uint64_t& value) {
  trim(b, e);
  if (b == e) return false;
  std::uint64_t v = 0;
  for (; b < e; ++b) {
    unsigned d = static_cast<unsigned char>(*b) - '0';
    if (d > 9) return false;
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  value = v;
  return true;
}

inline TraceEvent make_event(std::uint8_t op, std::uint64_t stream, std::uint64_t addr,
                             std::uint64_t size) {
  TraceEvent e;
  std::memset(&e, 0, sizeof e);
  e.op = op;
  e.stream = stream;
  e.addr = addr;
  e.size = size;
  return e;
}

}  // namespace

// ---- RMM CSV ----------------------------------------------------------------------------

bool RmmCsvParser::header(const char* b, const char* e) {
  if (b == e) return false;
  const char* f = b;
  for (const char* p = b;; ++p) {
    if (p == e || *p == ',') {
      const char* fb = f;
      const char* fe = p;
      trim(fb, fe);
      columns_.emplace_back(fb, fe);
      if (p == e) break;
      f = p + 1;
    }
  }
  auto find = [&](const char* name) -> long {
    for (std::size_t i = 0; i < columns_.size(); ++i)
      if (columns_[i] == name) return static_cast<long>(i);
    return -1;
  };
  long a = find("Action"), p = find("Pointer"), s = find("Size");
  if (a < 0 || p < 0 || s < 0) return false;  // the Python reader words the error
  i_action_ = static_cast<std::size_t>(a);
  i_pointer_ = static_cast<std::size_t>(p);
  i_size_ = static_cast<std::size_t>(s);
  i_stream_ = find("Stream");
  long width = std::max(std::max(a, p), std::max(s, i_stream_)) + 1;
  width_ = static_cast<std::size_t>(width);
  have_header_ = true;
  return true;
}

bool RmmCsvParser::line(const char* b, const char* e, Events& out) {
  if (e > b && e[-1] == '\r') --e;
  for (const char* p = b; p < e; ++p)
    if (csv_table.odd[static_cast<unsigned char>(*p)]) return false;
  if (!have_header_) return header(b, e);
  if (b == e) return true;  // a blank line
  // Field boundaries up to the widest column used.
  const char* starts[64];
  const char* ends[64];
  if (width_ > 64) return false;
  std::size_t n = 0;
  const char* f = b;
  for (const char* p = b; n < width_; ++p) {
    if (p == e || *p == ',') {
      starts[n] = f;
      ends[n] = p;
      ++n;
      if (p == e) break;
      f = p + 1;
    }
  }
  if (n < width_) return false;
  const char* ab = starts[i_action_];
  const char* ae = ends[i_action_];
  trim(ab, ae);
  std::size_t alen = static_cast<std::size_t>(ae - ab);
  std::uint8_t op;
  if (alen == 8 && std::memcmp(ab, "allocate", 8) == 0) {
    op = TraceEvent::op_alloc;
  } else if (alen == 4 && std::memcmp(ab, "free", 4) == 0) {
    op = TraceEvent::op_free;
  } else if (alen == 10 && std::memcmp(ab, "deallocate", 10) == 0) {
    op = TraceEvent::op_free;
  } else if (alen == 16 && std::memcmp(ab, "allocate failure", 16) == 0) {
    ++failures_;
    return true;
  } else {
    return false;
  }
  std::uint64_t addr, size, stream = 0;
  if (!parse_hex(starts[i_pointer_], ends[i_pointer_], addr)) return false;
  if (!parse_decimal(starts[i_size_], ends[i_size_], size)) return false;
  if (i_stream_ >= 0 && !parse_hex(starts[i_stream_], ends[i_stream_], stream)) return false;
  out.push_back(make_event(op, stream, addr, size));
  return true;
}

bool RmmCsvParser::feed(const char* data, std::size_t n, Events& out) {
  const char* p = data;
  const char* end = data + n;
  if (!carry_.empty()) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', n));
    if (nl == nullptr) {
      carry_.append(p, n);
      return carry_.size() <= max_csv_line;
    }
    carry_.append(p, nl);
    if (carry_.size() > max_csv_line) return false;
    if (!line(carry_.data(), carry_.data() + carry_.size(), out)) return false;
    carry_.clear();
    p = nl + 1;
  }
  while (p < end) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    if (nl == nullptr) {
      if (static_cast<std::size_t>(end - p) > max_csv_line) return false;
      carry_.assign(p, end);
      break;
    }
    if (static_cast<std::size_t>(nl - p) > max_csv_line) return false;
    if (!line(p, nl, out)) return false;
    p = nl + 1;
  }
  return true;
}

bool RmmCsvParser::finish(Events& out) {
  if (!carry_.empty()) {
    if (!line(carry_.data(), carry_.data() + carry_.size(), out)) return false;
    carry_.clear();
  }
  return have_header_;  // an empty file: the Python reader says so
}

// ---- Kineto JSON ------------------------------------------------------------------------

namespace {

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
          for (int k = 0; k < 4; ++k) v = v * 16 + static_cast<unsigned>(hex_digit(static_cast<unsigned char>(*b++)));
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
struct Field {
  enum Kind { none, integer, floating, string, object, other, boolean } kind = none;
  const char* b = nullptr;
  const char* e = nullptr;
  bool escaped = false;
};

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
          if (hex_digit(d[p + k]) < 0) return R::bail;
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
KinetoScanner::R KinetoScanner::event(std::size_t& pos, Events& out) {
  Cursor cur(pos);
  std::size_t& p = cur.p;
  if (d_[p] != '{') return R::bail;  // "a trace event is not a JSON object"
  Field name, args, ts;
  Field type, id, addr, bytes, allocated, reserved;
  ++p;
  R r = ws(p);
  if (r != R::ok) return r;
  auto read_field = [&](std::size_t& q, Field& f, int depth) -> R {
    const char* d = d_;
    f.b = d + q;
    char c = d[q];
    R rr;
    bool integer = false;
    if (c == '"') {
      rr = string(q, f.escaped);
      f.kind = Field::string;
      f.b += 1;
      f.e = d_ + q - 1;
      return rr;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      rr = number(q, integer);
      f.kind = integer ? Field::integer : Field::floating;
    } else if (c == 't' || c == 'f') {
      rr = value(q, depth);
      f.kind = Field::boolean;
    } else {
      rr = value(q, depth);
      f.kind = c == '{' ? Field::object : Field::other;
    }
    f.e = d_ + q;
    return rr;
  };
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
        r = read_field(p, name, 1);
      } else if (string_is(k0, k1, kesc, "ts", 2)) {
        r = read_field(p, ts, 1);
      } else if (string_is(k0, k1, kesc, "args", 4) && d_[p] == '{') {
        // args: an object whose device and memory fields are kept (the last one wins, as
        // for every repeated key).
        args = Field();
        args.kind = Field::object;
        type = id = addr = bytes = allocated = reserved = Field();
        ++p;
        if ((r = ws(p)) != R::ok) return r;
        if (d_[p] == '}') {
          ++p;
        } else {
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
            if (string_is(a0, a1, aesc, "Addr", 4)) f = &addr;
            else if (string_is(a0, a1, aesc, "Bytes", 5)) f = &bytes;
            else if (string_is(a0, a1, aesc, "Device Type", 11)) f = &type;
            else if (string_is(a0, a1, aesc, "Device Id", 9)) f = &id;
            else if (string_is(a0, a1, aesc, "Total Allocated", 15)) f = &allocated;
            else if (string_is(a0, a1, aesc, "Total Reserved", 14)) f = &reserved;
            if ((r = read_field(p, *f, 2)) != R::ok) return r;
            if ((r = ws(p)) != R::ok) return r;
            char x = d_[p++];
            if (x == '}') break;
            if (x != ',') return R::bail;
            if ((r = ws(p)) != R::ok) return r;
          }
        }
      } else if (string_is(k0, k1, kesc, "args", 4)) {
        args = Field();
        r = read_field(p, args, 1);
        type = id = addr = bytes = allocated = reserved = Field();
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
  if (name.kind != Field::string) return R::ok;
  if (!string_is(name.b, name.e, name.escaped, "[memory]", 8)) {
    if (string_is(name.b, name.e, name.escaped, "[OutOfMemory]", 13)) ++ooms;
    return R::ok;
  }
  if (args.kind != Field::object) return R::bail;  // "[memory] event without an 'args' object"
  std::int64_t dtype, did = 0;
  if (type.kind != Field::integer || !token_int64(type.b, type.e, dtype)) return R::bail;
  if (id.kind != Field::none && (id.kind != Field::integer || !token_int64(id.b, id.e, did)))
    return R::bail;
  std::size_t slot = count_device(dtype, did);
  if (want_type_ == count_devices) {
    if (!scans_ok) return R::ok;
    std::uint64_t a, mag;
    bool aneg, neg;
    std::int64_t total = 0;
    if (addr.kind != Field::integer || !token_magnitude(addr.b, addr.e, aneg, a) ||
        (aneg && a != 0) || bytes.kind != Field::integer ||
        !token_magnitude(bytes.b, bytes.e, neg, mag) ||
        (allocated.kind == Field::integer && !token_int64(allocated.b, allocated.e, total))) {
      scans_ok = false;
      drop_kept();
      device_scans.clear();
      return R::ok;
    }
    DeviceScan& d = device_scans[slot];
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
    if (keep_limit == 0 || kept_dropped) return R::ok;
    // What the device's own pass does with the event (the checks above are its own too).
    std::int64_t total_reserved = 0;
    double t = 0;
    int tk = ts_value(ts, t);
    if (tk < 0 || (reserved.kind == Field::integer &&
                   !token_int64(reserved.b, reserved.e, total_reserved))) {
      drop_kept();
      return R::ok;
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
    if (reserved.kind == Field::integer && (!d.have_reserved || total_reserved > d.peak_reserved)) {
      d.peak_reserved = total_reserved;
      d.have_reserved = true;
    }
    if (mag == 0) {
      ++d.zero_bytes;
      return R::ok;
    }
    if (d.kept.empty() || d.kept.back().size() == kept_chunk) {
      if (kept_bytes + kept_chunk * sizeof(TraceEvent) > keep_limit) {
        drop_kept();
        return R::ok;
      }
      d.kept.emplace_back();
      d.kept.back().reserve(kept_chunk);
      kept_bytes += kept_chunk * sizeof(TraceEvent);
    }
    d.kept.back().push_back(e);
    return R::ok;
  }
  if (dtype != want_type_ || (want_id_ >= 0 && did != want_id_)) return R::ok;
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
  int tk = ts_value(ts, t);
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

// ---- normalization ----------------------------------------------------------------------

void Normalizer::skip(Reason r) {
  if (skipped[r]++ == 0) reason_order.push_back(r);
}

void Normalizer::live_before(const TraceEvent* events, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const TraceEvent& e = events[i];
    if (e.size == 0) {
      skip(live_size_unknown);
      continue;
    }
    live_[e.addr] = e.size;
    synthetic_.insert(e.addr);
    streams_.insert(e.stream);
    pending.push_back(make_event(TraceEvent::op_alloc, e.stream, e.addr, e.size));
    ++synthetic_allocs;
    synthetic_alloc_bytes += e.size;
    ++allocs;
    alloc_bytes += e.size;
    if (e.size > largest) largest = e.size;
    live_bytes += e.size;
  }
  peak = live_bytes;
}

void Normalizer::feed(const TraceEvent* records, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const TraceEvent& r = records[i];
    std::uint64_t size = r.size;
    if (r.op == TraceEvent::op_alloc) {
      if (size == 0) {
        skip(zero_size_alloc);
        continue;
      }
      if (r.addr == 0) {
        skip(alloc_at_zero);
        continue;
      }
      auto [it, inserted] = live_.try_emplace(r.addr, size);
      if (!inserted) {
        if (!synthetic_.empty()) synthetic_.erase(r.addr);
        ++implicit_frees;
        ++frees;
        live_bytes -= it->second;
        pending.push_back(make_event(TraceEvent::op_free, r.stream, r.addr, it->second));
        it->second = size;
      }
      ++allocs;
      alloc_bytes += size;
      if (size > largest) largest = size;
      live_bytes += size;
      if (live_bytes > peak) peak = live_bytes;
    } else {
      if (r.addr == 0) {
        skip(free_of_zero);
        continue;
      }
      auto it = live_.find(r.addr);
      if (it == live_.end()) {
        ++unmatched_frees;
        unmatched_free_bytes += size;
        continue;
      }
      std::uint64_t allocated = it->second;
      live_.erase(it);
      if (size && size != allocated) ++free_size_mismatches;
      size = allocated;
      if (!synthetic_.empty() && synthetic_.erase(r.addr)) {
        ++frees_before_window;
        free_before_window_bytes += size;
      }
      ++frees;
      live_bytes -= size;
    }
    if (!have_last_stream_ || r.stream != last_stream_) {
      streams_.insert(r.stream);
      last_stream_ = r.stream;
      have_last_stream_ = true;
    }
    pending.push_back(make_event(r.op, r.stream, r.addr, size));
  }
}

void BeforeWindowScanner::grow() {
  std::vector<std::uint64_t> keys(keys_.empty() ? 1024 : keys_.size() * 2, 0);
  std::vector<std::uint64_t> live(keys.size() / 64, 0);
  keys_.swap(keys);
  live_.swap(live);
  shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(keys_.size()));
  std::size_t mask = keys_.size() - 1;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == 0) continue;
    std::size_t j = static_cast<std::size_t>((keys[i] * 0x9E3779B97F4A7C15ull) >> shift_);
    while (keys_[j] != 0) j = (j + 1) & mask;
    keys_[j] = keys[i];
    if ((live[i >> 6] >> (i & 63)) & 1) set_live(j, true);
  }
}

std::size_t BeforeWindowScanner::slot(std::uint64_t addr, bool& found) {
  if (4 * (used_ + 1) > 3 * keys_.size()) grow();  // at most 3/4 full
  std::size_t mask = keys_.size() - 1;
  std::size_t j = static_cast<std::size_t>((addr * 0x9E3779B97F4A7C15ull) >> shift_);
  for (;;) {
    std::uint64_t k = keys_[j];
    if (k == addr) {
      found = true;
      return j;
    }
    if (k == 0) {
      keys_[j] = addr;
      ++used_;
      found = false;
      return j;
    }
    j = (j + 1) & mask;
  }
}

void BeforeWindowScanner::feed(const TraceEvent* records, std::size_t n) {
  // scan_before_window: an address is live from its ALLOC (of a size) to its next FREE; a
  // FREE of an address never seen before names memory allocated before the window.
  bool found;
  // Each probe is a likely cache miss in a large table: fetch the slot of a record a few
  // ahead while this one is looked up (a grow() in between only wastes the prefetch).
  constexpr std::size_t ahead = 8;
  for (std::size_t i = 0; i < n; ++i) {
    if (i + ahead < n && !keys_.empty()) {
      std::uint64_t a = records[i + ahead].addr;
      __builtin_prefetch(keys_.data() +
                         static_cast<std::size_t>((a * 0x9E3779B97F4A7C15ull) >> shift_));
    }
    const TraceEvent& r = records[i];
    if (r.addr == 0) continue;
    if (r.op == TraceEvent::op_alloc) {
      if (r.size) set_live(slot(r.addr, found), true);
      continue;
    }
    std::size_t j = slot(r.addr, found);
    if (!found) {
      before.push_back(make_event(TraceEvent::op_alloc, r.stream, r.addr, r.size));
    } else if (is_live(j)) {
      set_live(j, false);
    }
  }
}

}  // namespace vmalloc::trace_parse
