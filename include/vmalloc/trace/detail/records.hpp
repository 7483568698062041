// What the text readers share: the raw record they append (TraceEvent, see replay.hpp), the
// vector they append it to, and a hex digit's value.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "vmalloc/trace/replay.hpp"

// The scanners' inner functions are not exported: direct calls the compiler can inline.
#define VMALLOC_TRACE_PARSE_INTERNAL __attribute__((visibility("hidden")))

namespace vmalloc::trace_parse {

using Events = std::vector<TraceEvent>;

namespace detail {

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

inline int hex_digit(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace detail
}  // namespace vmalloc::trace_parse
