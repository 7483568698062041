// The normalization of raw records: see include/vmalloc/trace/normalizer.hpp (record for
// record vmalloc/traces/_normalize.py).
#include "vmalloc/trace/normalizer.hpp"

namespace vmalloc::trace_parse {

using detail::make_event;
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
      auto [old, inserted] = live_.try_emplace(r.addr, size);
      if (!inserted) {
        if (!synthetic_.empty()) synthetic_.erase(r.addr);
        ++implicit_frees;
        ++frees;
        live_bytes -= *old;
        pending.push_back(make_event(TraceEvent::op_free, r.stream, r.addr, *old));
        *old = size;
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
      const std::size_t at = live_.find_slot(r.addr);
      const std::size_t recent = static_cast<std::size_t>(
          (r.addr * 0x9E3779B97F4A7C15ull) >> (64 - recent_bits));
      if (at == live_.npos) {
        if (!recent_frees_.empty() && recent_frees_[recent] == r.addr) {
          ++double_frees;  // freed already (not live since: a new ALLOC would make it live)
        } else {
          ++unmatched_frees;
          unmatched_free_bytes += size;
        }
        continue;
      }
      std::uint64_t allocated = live_.value_at(at);
      live_.erase_at(at);
      if (recent_frees_.empty()) recent_frees_.assign(std::size_t{1} << recent_bits, 0);
      recent_frees_[recent] = r.addr;
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

}  // namespace vmalloc::trace_parse
