// A PyTorch memory snapshot read from its pickle (PickleReader) in C++, for
// vmalloc/traces/torch_snapshot.py's TorchSnapshotReader through vmalloc/traces/_trace_parse.pyx.
//
// build() compacts the pickle's tree into what the reader uses (every device's history as
// (action, addr, size, stream) and the segments' live blocks), so the tree can be released;
// select() then gives one device's raw records, counters and blocks live before the window,
// exactly as the Python reader computes them. Where the Python reader would raise (an entry
// that is not a dict with a str 'action', an 'addr' that is not an int in [0, 2**64), a
// segment that is not a dict, ...) or the snapshot holds something not decided here (a sum
// past 64 bits), they return false and the Python reader reads the file: the fast path never
// words an error of its own about a snapshot's content.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vmalloc/trace/pickle_reader.hpp"
#include "vmalloc/trace/replay.hpp"

namespace vmalloc::trace_parse {

// One device's part of a snapshot (SnapshotHistory::select); its raw records come from
// SnapshotHistory::records.
struct SnapshotDevice {
  std::size_t index = 0;      // the device
  std::uint64_t entries = 0;  // history entries
  std::uint64_t records = 0;  // raw records (ALLOC / FREE) they give
  // Bits by entry: the free_requested entries that act as the free (no free_completed of the
  // address follows before it is allocated again).
  std::vector<std::uint64_t> effective;
  // (action id, entries) of every action, and of those not replayed (skipped), in order of
  // first appearance.
  std::vector<std::pair<std::uint32_t, std::uint64_t>> actions, skipped;
  std::uint64_t segments = 0;       // the device's segments
  std::int64_t segment_bytes = 0;   // their int total_size
  // The device's blocks in use at the dump, as ALLOC records (stream, addr, requested size) in
  // the order of TorchSnapshotReader.live_blocks(); and those whose address the history never
  // mentions.
  std::vector<TraceEvent> live, untouched;
  std::uint64_t untouched_bytes = 0;
};

class SnapshotHistory {
 public:
  // The snapshot of a pickle read to its end (its entries' summaries are taken, the rest
  // stays for the caller to clear); false: the Python reader decides (the value is not a dict
  // with a 'device_traces' list, 'segments' is neither false nor a list, ...).
  bool build(PickleReader& pickle);

  struct Device {
    bool is_list = false;      // device_traces[i] is a list (else the reader refuses it)
    std::uint64_t length = 0;  // its entries
    std::uint64_t first = 0;   // its first entry: entries_[first + i], or through order_
    bool direct = true;        // entries_[first + i] (the entries were pickled in order)
  };
  std::vector<Device> devices;       // device_traces, in order
  std::vector<std::string> actions;  // action names by id: 0 alloc, 1 free_requested, 2 free_completed

  // Device `index`'s history; false: the Python reader decides (it raises).
  bool select(std::size_t index, SnapshotDevice& out) const;
  // Appends to `out` the raw records of the device's entries [first, first + n), in order,
  // as TorchSnapshotReader.records() yields them.
  void records(const SnapshotDevice& device, std::size_t first, std::size_t n,
               std::vector<TraceEvent>& out) const;

 private:
  struct Block {  // a block in a live state
    std::uint64_t addr = 0, size = 0;
    bool addr_ok = false, size_ok = false;
  };
  struct Segment {
    bool is_dict = false;
    enum : std::uint8_t { device_missing, device_int, device_never } device_kind = device_missing;
    std::int64_t device = 0;
    bool stream_ok = true;  // 'stream' (default 0) an int in [0, 2**64)
    std::uint64_t stream = 0;
    enum : std::uint8_t { blocks_none, blocks_list, blocks_bad } blocks = blocks_none;
    enum : std::uint8_t { total_none, total_int, total_big } total_kind = total_none;
    __int128 total = 0;
    std::uint64_t first_block = 0, live_blocks = 0;
  };
  const SnapshotEntry& entry(const Device& d, std::size_t i) const {
    return d.direct ? entries_[d.first + i] : entries_[order_[d.first + i]];
  }

  detail::Chunked<SnapshotEntry> entries_;  // a non-dict entry: flags 0
  detail::Chunked<std::uint64_t> order_;    // devices not direct: their entries' rows
  std::vector<Segment> segments_;
  std::vector<Block> blocks_;
};

}  // namespace vmalloc::trace_parse
