// What the restricted unpickler's parts share (src/trace/pickle_reader.cpp: the stream and
// the opcodes; pickle_values.cpp: the values built; pickle_scan.cpp: the scan after a bail):
// protocol limits, little-endian arguments, the words a snapshot's keys are matched to.
#pragma once

#include <cstdint>
#include <string>

#include "vmalloc/trace/detail/records.hpp"

namespace vmalloc::trace_parse::detail {

// Python's pickle.HIGHEST_PROTOCOL: a higher PROTO is an error there.
constexpr unsigned highest_protocol = 5;
// A memo index further than this beyond twice the values stored so far is refused: Python's
// pickler numbers them densely, and CPython's unpickler would size its memo to twice the index.
constexpr std::uint64_t memo_slack = 1u << 16;

// An opcode's little-endian argument of n bytes.
inline std::uint64_t le(const unsigned char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// 1234567 as "1,234,567" (the errors' byte counts).
inline std::string thousands(std::uint64_t v) {
  std::string digits = std::to_string(v), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// The Word (pickle_reader.hpp) a str of n bytes at p is, or w_other.
VMALLOC_TRACE_PARSE_INTERNAL std::uint8_t word_of(const unsigned char* p, std::uint64_t n);

}  // namespace vmalloc::trace_parse::detail
