// A restricted unpickler for plain data (pickle protocols 2 to 5), for the PyTorch snapshot
// reader (vmalloc/traces/torch_snapshot.py through vmalloc/traces/_trace_parse.pyx).
//
// It walks the opcode stream once, fed in blocks, and builds a compact tree of values (no
// Python objects): None, bools, ints, floats, str, bytes, bytearray, and lists, tuples, dicts,
// sets and frozensets by identity (the memo can share one container between several places,
// as PyTorch's stack frames are). A history entry is kept as its SnapshotEntry and its frames
// list is dropped (see below). Each opcode is applied as CPython's C unpickler applies it (the
// stack's fence at the last MARK, POP of a MARK, MEMOIZE numbering, APPENDS of nothing, a read
// that passes the end of the frame being read).
//
// Outcomes, so that the fast path gives no answer the Python reader would not (but for the
// refusals under "error", of files that Python's unpickler refuses too or would allocate
// gigabytes for):
//  * done: the pickle is read; its value is root().
//  * bail: a construct this reader does not take (protocol 0 text opcodes, BUILD, a malformed
//    stream: a truncated pickle, an unknown opcode, an unhashable key): the caller reads the
//    file with Python's unpickler, which gives the value or words the error. Before saying so
//    the reader scans the rest of the stream as that unpickler would read it, opcode by
//    opcode, for the memo bombs below (which would otherwise reach it).
//  * error: a pickle nothing plain can come from, refused at once with a message naming the
//    opcode and its byte offset: an opcode that loads a class or calls a function (a plain-data
//    unpickler refuses it too, so no file reads differently), a length past the size limit, a
//    memo index far beyond the values stored (a few bytes that make Python's unpickler
//    allocate gigabytes), or a structure growing past memory_budget().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "vmalloc/trace/detail/chunked.hpp"

namespace vmalloc::trace_parse {

// Strings the snapshot reader looks up, recognized once, as they are read (PickleValue::word).
enum Word : std::uint8_t {
  w_other = 0,
  w_device_traces,
  w_segments,
  w_allocator_settings,
  w_action,
  w_addr,
  w_size,
  w_stream,
  w_device,
  w_blocks,
  w_total_size,
  w_state,
  w_address,
  w_requested_size,
  w_alloc,
  w_free_requested,
  w_free_completed,
  w_active_allocated,
  w_active_pending_free,
  w_active_awaiting_free,
  n_words
};

struct PickleValue {
  enum Kind : std::uint8_t {
    unset = 0,     // an empty memo slot
    none,
    boolean,       // v: 0 or 1
    integer,       // v: an int64
    big_unsigned,  // v: a uint64 in [2**63, 2**64)
    big_integer,   // v: a blob, the value's two's complement, little-endian
    floating,      // v: the double's bits
    str,           // v: a blob (UTF-8; surrogates allowed, as 'surrogatepass')
    bytes,         // v: a blob
    bytearray,     // v: a blob
    list,          // containers: v indexes containers()
    tuple,
    dict,
    set,
    frozenset,
  };
  std::uint64_t v = 0;
  Kind kind = unset;
  std::uint8_t word = w_other;  // str: its Word
  bool hashable = true;         // as a dict key or set member (a tuple: all its items)
};

// A container's values are kept in runs (one for each batch of APPENDS, SETITEMS, ...) of
// the shared value arena: a dict's as key, value, key, value.
struct PickleRun {
  std::uint64_t start = 0;  // in the value arena
  std::uint64_t count = 0;  // values
  std::uint64_t next = 0;   // the next run of the container, 0: none
};

struct PickleContainer {
  std::uint64_t first = 0, last = 0;  // runs (0: none); a compact dict: its SnapshotEntry
  std::uint64_t count : 62;           // values added in all (a dict: 2 an item)
  std::uint64_t compact : 1;          // a dict kept as a SnapshotEntry (see below)
  // A list whose values were dropped: one stored under a key a history entry does not use
  // (its stack frames), made just before the entry's items were set. Never needed by the
  // reader unless the memo puts it elsewhere: then complete() is false and the Python
  // reader decides.
  std::uint64_t dropped : 1;
  PickleContainer() : count(0), compact(0), dropped(0) {}
};

// A history entry of a snapshot (a dict with an "action"), as the snapshot reader uses it:
// a dict whose first SETITEMS holds the key "action" is kept as this summary of its items,
// not as a tree (the bulk of a snapshot is a million such dicts), updated by every item set
// later (the last value of a key wins). A compact dict met where the reader wants its other
// items (a segment, a block, the settings) is left to the Python reader.
struct SnapshotEntry {
  enum : std::uint8_t { has_action = 1, addr_ok = 2, size_ok = 4, stream_ok = 8 };
  std::uint64_t addr = 0, size = 0, stream = 0;  // 0 where absent (size, stream: the default)
  std::uint32_t action = 0;  // PickleReader::actions() index, with has_action (a str)
  // has_action: "action" is a str; *_ok: the key is an int in [0, 2**64) (size and stream:
  // or absent, as entry.get(key, 0)).
  std::uint8_t flags = size_ok | stream_ok;
};

class PickleReader {
 public:
  enum class Status { more, done, bail, error };

  // limit: the most (decompressed) bytes read, as the Python reader's MAX_SNAPSHOT_BYTES.
  explicit PickleReader(std::uint64_t limit);

  // The next block of the file. more: go on; done: the pickle ended (the rest of the file is
  // not read, as Python's unpickler does not read it); bail / error: stop (see the header).
  Status feed(const char* data, std::size_t n);
  Status finish();  // the end of the file
  Status status() const { return status_; }
  const std::string& error() const { return error_; }

  // The pickled value, once done.
  const PickleValue& root() const { return root_; }
  const PickleContainer& container(const PickleValue& v) const { return containers_[v.v]; }
  bool compact(const PickleValue& v) const {
    return v.kind == PickleValue::dict && containers_[v.v].compact;
  }
  // Whether each() gives all of a container's values (false: a dropped list).
  bool complete(const PickleValue& c) const { return !containers_[c.v].dropped; }
  const SnapshotEntry& entry(const PickleValue& compact_dict) const {
    return entries_[containers_[compact_dict.v].first];
  }
  // Action names by SnapshotEntry::action: 0 alloc, 1 free_requested, 2 free_completed.
  const std::vector<std::string>& actions() const { return actions_; }
  // The action id of a str value (added to actions() if new).
  std::uint32_t action_id(const PickleValue& str);
  std::string_view blob(const PickleValue& v) const {
    const Blob& b = blobs_[v.v];
    return std::string_view(chars_.data() + b.offset, b.size);
  }
  // The values of a list, tuple, set or frozenset (a dict's keys and values alternate, a
  // compact dict has none), in order: f(const PickleValue&) for each.
  template <class F>
  void each(const PickleValue& c, F&& f) const {
    for (std::uint64_t r = containers_[c.v].first; r != 0; r = runs_[r].next) {
      const PickleRun& run = runs_[r];
      for (std::uint64_t i = 0; i < run.count; ++i) f(values_[run.start + i]);
    }
  }
  // A container's values in order (a dict's keys and values alternate), copied to `out`;
  // false where they are not all kept (a compact dict, a dropped list).
  bool values(const PickleValue& c, std::vector<PickleValue>& out) const {
    out.clear();
    if (containers_[c.v].compact || containers_[c.v].dropped) return false;
    each(c, [&](const PickleValue& v) { out.push_back(v); });
    return true;
  }
  // A dict's items in order: f(const PickleValue& key, const PickleValue& value) for each.
  template <class F>
  void each_item(const PickleValue& dict, F&& f) const {
    for (std::uint64_t r = containers_[dict.v].first; r != 0; r = runs_[r].next) {
      const PickleRun& run = runs_[r];
      for (std::uint64_t i = 0; i + 1 < run.count; i += 2)
        f(values_[run.start + i], values_[run.start + i + 1]);
    }
  }
  // dict[word] (the last value stored under that key, as in a Python dict), or nullptr (a
  // compact dict: always).
  const PickleValue* find(const PickleValue& dict, Word word) const;
  // The value's truth, as bool() in Python.
  bool truthy(const PickleValue& v) const;
  // Moves the history entries' summaries out (SnapshotHistory keeps them; entry() is then
  // invalid).
  detail::Chunked<SnapshotEntry> take_entries() { return std::move(entries_); }
  // Bytes held by the tree, the stack and the memo.
  std::uint64_t memory() const;
  // The memory allowed after reading `bytes` bytes: a linear bound, several times what real
  // snapshots take (3 to 4 bytes a byte of pickle, plus the tables' first chunks) and below
  // what a pickle of one repeated opcode (EMPTY_DICT, DUP) makes.
  static std::uint64_t memory_budget(std::uint64_t bytes) { return 16 * bytes + (16u << 20); }
  // Releases the tree (after the caller has taken what it needs).
  void clear();

 private:
  struct Blob {
    std::uint64_t offset = 0, size = 0;
  };
  Status run();
  Status scan();  // after a bail: the rest of the stream checked for memo bombs
  Status fail(const char* what, std::size_t at);
  Status memo_bomb(std::uint64_t index, std::size_t at);
  Status refuse(unsigned char op, std::size_t at, std::string_view module, std::string_view name);
  Status too_long(unsigned char op, std::size_t at, std::uint64_t size);
  PickleValue& push(PickleValue::Kind kind, std::uint64_t v);
  std::uint64_t new_container();
  std::uint64_t new_blob(const unsigned char* p, std::uint64_t n);
  void add(std::uint64_t container, std::size_t from);  // moves stack_[from:] into it
  void set_items(std::uint64_t dict, std::size_t from);  // SETITEM(S) of stack_[from:]
  void drop(const PickleValue& value);  // a compact dict's value under a key it ignores
  bool put(std::uint64_t index, std::size_t at, Status& status);
  std::size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  // One read of k bytes as CPython's unpickler makes it: from the frame being read while it
  // holds them; a read that passes the frame's end would drop the frame's rest and read the
  // bytes after it (false: Python's unpickler decides such a file).
  bool take(std::uint64_t k) {
    if (frame_left_ == 0) return true;
    if (k > frame_left_) return false;
    frame_left_ -= k;
    return true;
  }

  std::uint64_t limit_;
  std::string buf_;
  std::size_t pos_ = 0;          // the next opcode in buf_
  std::uint64_t base_ = 0;       // the file offset of buf_[0]
  std::uint64_t received_ = 0;   // bytes fed so far
  std::uint64_t frame_end_ = 0;  // the file must hold this many bytes (the last FRAME's end)
  std::uint64_t frame_left_ = 0; // bytes of the frame being read not read yet
  bool eof_ = false;
  bool stopped_ = false;  // STOP read; waiting for the end of the last frame
  bool scanning_ = false;  // bailed out: scanning the rest (scan())
  std::uint64_t skip_ = 0;  // scanning: bytes still to drop (a payload past the buffer)
  Status status_ = Status::more;
  std::string error_;

  std::vector<PickleValue> stack_;
  std::vector<std::size_t> marks_;
  detail::Chunked<PickleValue> memo_;
  std::uint64_t memo_len_ = 0;  // memo slots set (MEMOIZE's next index, as CPython counts)
  std::uint64_t puts_ = 0;

  detail::Chunked<PickleValue> values_;
  detail::Chunked<PickleRun> runs_;
  detail::Chunked<PickleContainer> containers_;
  detail::Chunked<Blob> blobs_;
  std::string chars_;
  detail::Chunked<SnapshotEntry> entries_;
  std::vector<std::string> actions_{"alloc", "free_requested", "free_completed"};
  std::unordered_map<std::string, std::uint32_t> action_ids_;
  PickleValue root_;
};

}  // namespace vmalloc::trace_parse
