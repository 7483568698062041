// The out-of-line JSON token scans: see include/vmalloc/trace/detail/json_tokens.hpp.
#include "vmalloc/trace/detail/json_tokens.hpp"

#include <algorithm>

#include "vmalloc/trace/detail/utf8.hpp"

namespace vmalloc::trace_parse::detail {
namespace {

// String bytes that need a closer look: the quote, the backslash, control characters and
// non-ASCII (validated as UTF-8 as Python's strict decoder does).
struct JsonTable {
  bool special[256];
  JsonTable() {
    for (int c = 0; c < 256; ++c) special[c] = c == '"' || c == '\\' || c < 0x20 || c >= 0x80;
  }
};
const JsonTable json_table;

}  // namespace

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

Scan JsonText::string_rest(std::size_t& pos, bool& escaped) const {
  // pos at the opening quote; left after the closing one. A local cursor: through the
  // reference the compiler would store it before each byte read (a char may alias it).
  std::size_t p = pos + 1;
  const unsigned char* d = reinterpret_cast<const unsigned char*>(this->d);
  const std::size_t n = this->n;
  escaped = false;
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
    if (p >= n) return end();
    unsigned char c = d[p];
    if (c == '"') {
      pos = p + 1;
      return Scan::ok;
    }
    if (c == '\\') {
      escaped = true;
      if (p + 1 >= n) return end();
      unsigned char x = d[p + 1];
      if (x == 'u') {
        if (p + 6 > n) return end();
        for (int k = 2; k < 6; ++k)
          if (hex_digit(d[p + k]) < 0) return Scan::bail;
        p += 6;
      } else if (x == '"' || x == '\\' || x == '/' || x == 'b' || x == 'f' || x == 'n' ||
                 x == 'r' || x == 't') {
        p += 2;
      } else {
        return Scan::bail;
      }
      continue;
    }
    if (c < 0x20) return Scan::bail;  // strict: no raw control characters
    // UTF-8, as Python's strict decoder: no overlongs, surrogates or code points > U+10FFFF.
    std::size_t len;
    switch (utf8_sequence(d + p, n - p, /*surrogates=*/false, len)) {
      case Utf8::invalid: return Scan::bail;
      case Utf8::cut: return end();
      case Utf8::ok: break;
    }
    p += len;
  }
}

Scan JsonText::literal(std::size_t& p, const char* word, std::size_t len) const {
  std::size_t have = std::min(len, n - p);
  if (std::memcmp(d + p, word, have) != 0) return Scan::bail;
  if (have < len) return end();
  p += len;
  return Scan::ok;
}

// Iterative, with the open containers on a stack of their own: skipping an event's nested
// arrays (a profiler's "Input Dims") makes no call per level.
Scan JsonText::skip(std::size_t& pos, int depth) const {
  std::size_t p = pos;
  bool in_object[max_json_depth + 1];  // the open containers, innermost last
  int top = 0;
  Scan r;
  for (;;) {
    // At the start of a value.
    const char c = d[p];
    if (c == '{' || c == '[') {
      if (depth + top >= max_json_depth) return Scan::bail;
      const char close = c == '{' ? '}' : ']';
      ++p;
      if ((r = ws(p)) != Scan::ok) return r;
      if (d[p] == close) {
        ++p;
      } else {
        in_object[top++] = c == '{';
        if (c == '{') goto key;
        continue;
      }
    } else if (c == '"') {
      bool escaped;
      if ((r = string(p, escaped)) != Scan::ok) return r;
    } else if (c == 't') {
      if ((r = literal(p, "true", 4)) != Scan::ok) return r;
    } else if (c == 'f') {
      if ((r = literal(p, "false", 5)) != Scan::ok) return r;
    } else if (c == 'n') {
      if ((r = literal(p, "null", 4)) != Scan::ok) return r;
    } else {
      JsonNumber num;
      if ((r = number(p, num)) != Scan::ok) return r;
    }
    // After a value: the containers it closes, then the next element's start.
    for (;;) {
      if (top == 0) {
        pos = p;
        return Scan::ok;
      }
      if ((r = ws(p)) != Scan::ok) return r;
      const char x = d[p++];
      if (x == ',') break;
      if (x != (in_object[top - 1] ? '}' : ']')) return Scan::bail;
      --top;
    }
    if ((r = ws(p)) != Scan::ok) return r;
    if (!in_object[top - 1]) continue;
  key:  // an object member's key and colon
    if (d[p] != '"') return Scan::bail;
    {
      bool escaped;
      if ((r = string(p, escaped)) != Scan::ok) return r;
    }
    if ((r = ws(p)) != Scan::ok) return r;
    if (d[p] != ':') return Scan::bail;
    ++p;
    if ((r = ws(p)) != Scan::ok) return r;
  }
}

}  // namespace vmalloc::trace_parse::detail
