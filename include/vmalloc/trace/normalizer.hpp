// The normalization every raw-record reader shares (vmalloc/traces/_normalize.py) in C++:
// raw ALLOC / FREE records in, consistent events out, with the counters of TraceInfo.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_set>
#include <vector>

#include "vmalloc/base/detail/flat_map.hpp"
#include "vmalloc/trace/detail/records.hpp"

namespace vmalloc::trace_parse {

// vmalloc/traces/_normalize.py's normalized_batches, record for record.
class Normalizer {
 public:
  enum Reason { live_size_unknown = 0, zero_size_alloc, alloc_at_zero, free_of_zero, n_reasons };
  void live_before(const TraceEvent* events, std::size_t n);  // ALLOC records, in order
  void feed(const TraceEvent* records, std::size_t n);

  Events pending;  // normalized events not yet taken
  std::uint64_t skipped[n_reasons] = {};
  std::vector<int> reason_order;  // reasons in order of first skip
  std::uint64_t implicit_frees = 0, unmatched_frees = 0, free_size_mismatches = 0;
  // FREEs of an address the trace allocated and freed already (not allocated again since),
  // recognized while that free is among the recent ones (recent_bits): counted apart from the
  // unmatched frees (memory the trace never allocated).
  std::uint64_t double_frees = 0;
  static constexpr unsigned recent_bits = 16;  // 65,536 slots, 512 KiB
  std::uint64_t synthetic_allocs = 0, frees_before_window = 0;
  // Sums that Python keeps as unbounded ints: 128 bits here, read with wide().
  unsigned __int128 unmatched_free_bytes = 0, synthetic_alloc_bytes = 0, alloc_bytes = 0;
  unsigned __int128 live_bytes = 0, peak = 0, free_before_window_bytes = 0;
  enum Wide { w_unmatched_free_bytes, w_synthetic_alloc_bytes, w_alloc_bytes, w_live_bytes, w_peak,
              w_free_before_window_bytes };
  void wide(int which, std::uint64_t& hi, std::uint64_t& lo) const {
    unsigned __int128 v = which == w_unmatched_free_bytes    ? unmatched_free_bytes
                          : which == w_synthetic_alloc_bytes ? synthetic_alloc_bytes
                          : which == w_alloc_bytes           ? alloc_bytes
                          : which == w_live_bytes            ? live_bytes
                          : which == w_peak                  ? peak
                                                             : free_before_window_bytes;
    hi = static_cast<std::uint64_t>(v >> 64);
    lo = static_cast<std::uint64_t>(v);
  }
  std::uint64_t allocs = 0, frees = 0, largest = 0;
  std::size_t live_count() const { return live_.size(); }
  std::size_t stream_count() const { return streams_.size(); }

 private:
  void skip(Reason r);
  vmalloc::detail::FlatMap<std::uint64_t> live_;  // live address -> its size
  // The address of the last free that hashed to each slot (empty until the first free): an
  // address not live that is found here was freed already, so freeing it again is a double
  // free. Direct-mapped so that remembering frees costs one store, not a table that grows
  // with every address the trace ever used.
  std::vector<std::uint64_t> recent_frees_;
  std::unordered_set<std::uint64_t> synthetic_;  // synthetic ALLOCs not freed yet
  std::unordered_set<std::uint64_t> streams_;
  std::uint64_t last_stream_ = 0;  // streams_ holds it: most events are on the same stream
  bool have_last_stream_ = false;
};

}  // namespace vmalloc::trace_parse
