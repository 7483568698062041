// One UTF-8 sequence checked as Python's decoders check it: no overlong forms, nothing past
// U+10FFFF; encoded surrogates only where the decoder passes them (pickle's str uses
// 'surrogatepass', json's strict 'utf-8' refuses them). Shared by the pickle and JSON readers.
#pragma once

#include <cstddef>

namespace vmalloc::trace_parse::detail {

enum class Utf8 { ok, invalid, cut };

// The sequence led by p[0] (a byte >= 0x80), `avail` bytes readable from p: ok with its length
// in `len`, invalid, or cut (valid so far, `len` bytes needed).
inline Utf8 utf8_sequence(const unsigned char* p, std::size_t avail, bool surrogates,
                          std::size_t& len) noexcept {
  const unsigned c = p[0];
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED && !surrogates) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return Utf8::invalid;
  }
  if (len > avail) return Utf8::cut;
  if (p[1] < lo || p[1] > hi) return Utf8::invalid;
  for (std::size_t k = 2; k < len; ++k)
    if (p[k] < 0x80 || p[k] > 0xBF) return Utf8::invalid;
  return Utf8::ok;
}

}  // namespace vmalloc::trace_parse::detail
