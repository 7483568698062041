// JSON tokens as Python's json module reads them (strict: no NaN or Infinity, no raw control
// characters in strings, UTF-8 validated), scanned in a block of text that may end inside a
// token. Each scan answers ok, more (the token may go on in the next block: the caller parses
// its record again once that block is there) or bail (not JSON the fast path is certain of:
// the Python reader decides). The Kineto scanner's tokenizer; the event assembly is in
// src/trace/kineto_events.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "vmalloc/trace/detail/records.hpp"

namespace vmalloc::trace_parse::detail {

enum class Scan { ok, more, bail };

// Python's decoder stops at its recursion limit.
constexpr int max_json_depth = 200;

// A number token as scanned: `integer` if it has no fraction or exponent; for an integer of at
// most 19 digits (which always fits in 64 bits) `mag` is its magnitude, converted as the
// digits were scanned so that the fields the reader uses are not read twice.
struct JsonNumber {
  bool integer;
  bool neg;
  bool exact;  // mag holds the value (an integer of at most 19 digits)
  std::uint64_t mag;
};

// The text scanned: d[0, n), `eof` if nothing follows it.
struct JsonText {
  const char* d = nullptr;
  std::size_t n = 0;
  bool eof = false;

  Scan end() const { return eof ? Scan::bail : Scan::more; }

  // Whitespace. Most gaps between tokens are empty: one compare ends them at a token byte
  // (every JSON token starts above ' '). Any other byte <= ' ' (a control byte) also ends a
  // gap; the caller, expecting a token there, refuses it. An indented trace is half
  // whitespace, in runs of a newline and an indent: sixteen bytes are classified at a time
  // (for runs of 1-4 bytes about as many instructions as byte by byte, with no loop exit
  // that depends on the run's length).
  Scan ws(std::size_t& p) const {
    if (p < n && static_cast<unsigned char>(d[p]) > ' ') return Scan::ok;
    // One space, as after a member's colon.
    if (p + 1 < n && d[p] == ' ' && static_cast<unsigned char>(d[p + 1]) > ' ') {
      ++p;
      return Scan::ok;
    }
#if defined(__SSE2__)
    while (p + 16 <= n) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + p));
      const __m128i space = _mm_or_si128(
          _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(' ')), _mm_cmpeq_epi8(x, _mm_set1_epi8('\n'))),
          _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('\r')), _mm_cmpeq_epi8(x, _mm_set1_epi8('\t'))));
      const unsigned other = ~static_cast<unsigned>(_mm_movemask_epi8(space)) & 0xFFFFu;
      if (other != 0) {
        p += static_cast<std::size_t>(__builtin_ctz(other));
        return Scan::ok;
      }
      p += 16;
    }
#endif
    while (p < n) {
      const unsigned char c = static_cast<unsigned char>(d[p]);
      if (c > ' ' || (c != ' ' && c != '\n' && c != '\r' && c != '\t')) return Scan::ok;
      ++p;
    }
    return end();
  }

  // A string at p (its opening quote); p left after the closing quote. `escaped`: it holds a
  // backslash escape (compare it with string_is).
  inline Scan string(std::size_t& p, bool& escaped) const;
  // A number at p (a '-' or a digit).
  inline Scan number(std::size_t& p, JsonNumber& num) const;
  // Any value at p, validated and skipped; `depth` containers enclose it. value() takes
  // strings and numbers inline (most members of an event), skip() anything.
  inline Scan value(std::size_t& p, int depth) const;
  VMALLOC_TRACE_PARSE_INTERNAL Scan skip(std::size_t& p, int depth) const;
  // The general string scan (escapes, control bytes, UTF-8, long strings).
  VMALLOC_TRACE_PARSE_INTERNAL Scan string_rest(std::size_t& p, bool& escaped) const;
  VMALLOC_TRACE_PARSE_INTERNAL Scan literal(std::size_t& p, const char* word,
                                            std::size_t len) const;
};

inline Scan JsonText::string(std::size_t& p, bool& escaped) const {
#if defined(__SSE2__)
  // A plain string that ends within the next sixteen bytes: the first special byte (a quote,
  // a backslash, a control byte or non-ASCII; a signed "< 0x20" takes the bytes >= 0x80, which
  // are negative) is its closing quote.
  if (p + 17 <= n) {
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
        return Scan::ok;
      }
    }
  }
#endif
  return string_rest(p, escaped);
}

inline Scan JsonText::number(std::size_t& pos, JsonNumber& num) const {
  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)? ; a token that reaches the end of the block
  // may go on in the next one.
  std::size_t p = pos;
  const std::size_t start = p;
  num.integer = true;
  num.neg = d[p] == '-';
  if (num.neg && ++p >= n) return end();
  std::uint64_t v = 0;
  const std::size_t first = p;
  if (d[p] == '0') {
    ++p;
  } else if (static_cast<unsigned char>(d[p] - '1') < 9) {
    // The value as the digits go by (wrapping past 19 digits: then `exact` is false).
    for (unsigned dig; p < n && (dig = static_cast<unsigned char>(d[p] - '0')) < 10; ++p)
      v = v * 10 + dig;
  } else {
    return Scan::bail;  // -Infinity and such: rare, the Python reader takes them
  }
  if (p >= n) return end();
  num.mag = v;
  num.exact = p - first <= 19;
  if (d[p] == '.') {
    num.integer = false;
    const std::size_t digits = ++p;
    while (p < n && static_cast<unsigned char>(d[p] - '0') < 10) ++p;
    if (p >= n) return end();
    if (p == digits) return Scan::bail;
  }
  if (d[p] == 'e' || d[p] == 'E') {
    num.integer = false;
    if (++p >= n) return end();
    if (d[p] == '+' || d[p] == '-') ++p;
    const std::size_t digits = p;
    while (p < n && static_cast<unsigned char>(d[p] - '0') < 10) ++p;
    if (p >= n) return end();
    if (p == digits) return Scan::bail;
  }
  if (p - start > 1000) return Scan::bail;  // Python's int() has a digit limit
  num.exact = num.exact && num.integer;
  pos = p;
  return Scan::ok;
}

inline Scan JsonText::value(std::size_t& p, int depth) const {
  const char c = d[p];
  if (c == '"') {
    bool escaped;
    return string(p, escaped);
  }
  if (c == '-' || static_cast<unsigned char>(c - '0') < 10) {
    JsonNumber num;
    return number(p, num);
  }
  return skip(p, depth);
}

// A string's raw text (between its quotes) compared with an ASCII word, its escapes decoded
// (a \u escape beyond ASCII never equals an ASCII word).
VMALLOC_TRACE_PARSE_INTERNAL bool string_is_escaped(const char* b, const char* e,
                                                    const char* word, std::size_t len);

inline __attribute__((always_inline)) bool string_is(const char* b, const char* e, bool escaped,
                                                      const char* word, std::size_t len) {
  if (!escaped) return static_cast<std::size_t>(e - b) == len && std::memcmp(b, word, len) == 0;
  return string_is_escaped(b, e, word, len);
}

// Decimal digits [b, e) as uint64; false if the value does not fit. Up to 19 digits always
// fit, so only longer tokens pay for the overflow checks.
inline bool digits_u64(const char* b, const char* e, std::uint64_t& out) {
  std::uint64_t v = 0;
  if (e - b <= 19) {
    for (; b < e; ++b) v = v * 10 + static_cast<unsigned>(static_cast<unsigned char>(*b) - '0');
    out = v;
    return true;
  }
  for (; b < e; ++b) {
    unsigned dig = static_cast<unsigned char>(*b) - '0';
    if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, dig, &v)) return false;
  }
  out = v;
  return true;
}

}  // namespace vmalloc::trace_parse::detail
