// The C++ scanner of PyTorch profiler (Kineto) JSON traces, for vmalloc/_trace_parse.pyx.
//
// The parsers are streaming: feed() takes blocks of the (decompressed, BOM-stripped) file and
// appends raw records (op, stream, addr, size) to `out`, holding at most one incomplete line or
// trace event between blocks. They accept only input whose meaning is certain; at anything
// else (a syntax error, a construct the Python reader treats specially, an over-long record)
// they return false ("bail") and the caller reads the file again with the Python reader, which
// gives the exact event sequence or the exact error. So the fast path never decides an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/trace/before_window.hpp"
#include "vmalloc/trace/detail/json_tokens.hpp"
#include "vmalloc/trace/detail/records.hpp"

namespace vmalloc::trace_parse {

// The [memory] events of a chrome-trace JSON (vmalloc/traces/kineto.py, _json_stream.py).
class KinetoScanner {
 public:
  // want_id < 0: any device id of that type (CPU traces). want_type == count_devices: no
  // device is read, the memory events are counted by device (KinetoReader.devices) and each
  // device is scanned for memory live before the window (device_scans), so that the pass
  // that follows for one device needs no scan of its own.
  static constexpr std::int64_t count_devices = INT64_MIN;
  struct Field;        // a member's value as found (kineto_events.cpp)
  struct EventFields;  // the members of an event the reader looks at
  KinetoScanner(std::int64_t want_type, std::int64_t want_id);
  bool feed(const char* data, std::size_t n, Events& out);
  bool finish(Events& out);

  // Top-level scalar members, as JSON text (key with its quotes, value), in file order.
  std::vector<std::pair<std::string, std::string>> metadata;
  // (device type, device id) -> memory events, in order of first appearance.
  std::vector<std::pair<std::pair<std::int64_t, std::int64_t>, std::uint64_t>> devices;
  std::uint64_t out_of_order = 0, ooms = 0, zero_bytes = 0, matched = 0;
  // PyTorch's "Total Allocated" / "Total Reserved" of the device's events (JSON integers):
  // the peaks, and the first event's Total Allocated with its Bytes (sign and magnitude).
  bool have_allocated = false, have_reserved = false;
  std::int64_t peak_allocated = 0, peak_reserved = 0, first_allocated = 0;
  bool first_bytes_negative = false;
  std::uint64_t first_bytes = 0;

  // count_devices: per device (parallel to devices), its scan_before_window and the first
  // event's Total Allocated with its Bytes; valid only while scans_ok (false once an event
  // had fields the device's own pass would not take: then that pass scans for itself).
  struct DeviceScan {
    BeforeWindowScanner scan;
    Events pending;  // records not yet fed to scan (fed in batches of scan_batch)
    bool have_allocated = false;
    std::int64_t first_allocated = 0;
    bool first_bytes_negative = false;
    std::uint64_t first_bytes = 0;
    // keep_limit > 0: the device's raw memory records (chunks of kept_chunk), with what its
    // own pass would count (KinetoReader.records), so that pass need not read the file again.
    std::vector<Events> kept;
    std::uint64_t matched = 0, out_of_order = 0, zero_bytes = 0;
    bool have_ts = false;
    double last_ts = 0;
    bool have_peak_allocated = false, have_reserved = false;
    std::int64_t peak_allocated = 0, peak_reserved = 0;
  };
  std::vector<DeviceScan> device_scans;
  bool scans_ok = true;
  // count_devices: the bytes of records the device scans may keep (0: none). Beyond it, or
  // at an event the device's own pass would bail at, every kept record is dropped
  // (kept_dropped) and the device's pass reads the file.
  static constexpr std::size_t scan_batch = 256;
  static constexpr std::size_t kept_chunk = 16384;  // records per chunk (512 KiB)
  std::size_t keep_limit = 0, kept_bytes = 0;
  bool kept_dropped = false;

 private:
  // The scanner in two parts: the streaming driver and the top-level members
  // (kineto_scanner.cpp), the trace events (kineto_events.cpp); the tokens are JsonText's.
  using R = detail::Scan;
  VMALLOC_TRACE_PARSE_INTERNAL R run(Events& out);
  VMALLOC_TRACE_PARSE_INTERNAL R member(std::size_t& p);
  VMALLOC_TRACE_PARSE_INTERNAL R field(std::size_t& p, Field& f, int depth);
  VMALLOC_TRACE_PARSE_INTERNAL R args_members(std::size_t& p, EventFields& ev);
  VMALLOC_TRACE_PARSE_INTERNAL R event(std::size_t& p, Events& out);
  VMALLOC_TRACE_PARSE_INTERNAL void count_event(const EventFields& ev, DeviceScan& d);
  VMALLOC_TRACE_PARSE_INTERNAL R device_event(const EventFields& ev, Events& out);
  VMALLOC_TRACE_PARSE_INTERNAL std::size_t count_device(std::int64_t type, std::int64_t id);
  VMALLOC_TRACE_PARSE_INTERNAL void drop_kept();

  void view(const std::string& s) {
    t_.d = s.data();
    t_.n = s.size();
  }
  // How much of a block is first added to a cut event (most events are far shorter).
  static constexpr std::size_t stitch_bytes = 16384;

  std::int64_t want_type_, want_id_;
  std::string buf_;  // the unparsed tail of the blocks so far (a cut event), and its stitching
  detail::JsonText t_;  // the text parsed: buf_ or the caller's block (eof: the last)
  std::size_t pos_ = 0;  // in t_
  int state_ = 0;
  bool in_object_ = false;
  bool found_events_ = false;
  bool have_ts_ = false;
  double last_ts_ = 0;
};

}  // namespace vmalloc::trace_parse
