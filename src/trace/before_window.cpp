// The scan for memory allocated before a trace's window: see
// include/vmalloc/trace/before_window.hpp.
#include "vmalloc/trace/before_window.hpp"

namespace vmalloc::trace_parse {

using detail::make_event;
void BeforeWindowScanner::feed(const TraceEvent* records, std::size_t n) {
  // scan_before_window: an address is live from its ALLOC (of a size) to its next FREE; a
  // FREE of an address never seen before names memory allocated before the window.
  // Each probe is a likely cache miss in a large table: fetch the slot of a record a few
  // ahead while this one is looked up (a growth in between only wastes the prefetch).
  constexpr std::size_t ahead = 8;
  for (std::size_t i = 0; i < n; ++i) {
    if (i + ahead < n) seen_.prefetch(records[i + ahead].addr);
    const TraceEvent& r = records[i];
    if (r.addr == 0) continue;
    if (r.op == TraceEvent::op_alloc) {
      if (r.size) seen_[r.addr] = true;
      continue;
    }
    auto [live, inserted] = seen_.try_emplace(r.addr, false);
    if (inserted) {
      before.push_back(make_event(TraceEvent::op_alloc, r.stream, r.addr, r.size));
    } else {
      *live = false;
    }
  }
}

}  // namespace vmalloc::trace_parse
