// The scan of raw records for memory allocated before a trace's window (the Kineto device
// count runs it on every device as it reads), for vmalloc/traces/_trace_parse.pyx.
#pragma once

#include <cstddef>
#include <cstdint>

#include "vmalloc/base/detail/flat_map.hpp"
#include "vmalloc/trace/detail/records.hpp"

namespace vmalloc::trace_parse {

// vmalloc/traces/_normalize.py's scan_before_window: frees of addresses first seen freed.
class BeforeWindowScanner {
 public:
  void feed(const TraceEvent* records, std::size_t n);
  Events before;  // as ALLOC records (stream, addr, size), in order of appearance
 private:
  // Each address seen, with whether it is live (one probe an event; node-based sets made
  // this scan a tenth of the device count).
  vmalloc::detail::FlatMap<bool> seen_;
};

}  // namespace vmalloc::trace_parse
