// The restricted unpickler: see include/vmalloc/trace/pickle_reader.hpp. Each opcode below
// follows CPython's C unpickler (Modules/_pickle.c), where it bails out instead of raising.
#include "vmalloc/trace/pickle_reader.hpp"

#include <cstring>

#include "vmalloc/trace/detail/utf8.hpp"

namespace vmalloc::trace_parse {
namespace {

// Python's pickle.HIGHEST_PROTOCOL: a higher PROTO is an error there.
constexpr unsigned highest_protocol = 5;
// A memo index further than this beyond twice the values stored so far is refused: Python's
// pickler numbers them densely, and CPython's unpickler would size its memo to twice the index.
constexpr std::uint64_t memo_slack = 1u << 16;

struct WordName {
  const char* text;
  std::size_t size;
};
constexpr WordName word_names[n_words] = {
    {"", 0},
    {"device_traces", 13},
    {"segments", 8},
    {"allocator_settings", 18},
    {"action", 6},
    {"addr", 4},
    {"size", 4},
    {"stream", 6},
    {"device", 6},
    {"blocks", 6},
    {"total_size", 10},
    {"state", 5},
    {"address", 7},
    {"requested_size", 14},
    {"alloc", 5},
    {"free_requested", 14},
    {"free_completed", 14},
    {"active_allocated", 16},
    {"active_pending_free", 19},
    {"active_awaiting_free", 20},
};

std::uint8_t word_of(const unsigned char* p, std::uint64_t n) {
  if (n > 20) return w_other;
  for (std::uint8_t w = 1; w < n_words; ++w)
    if (word_names[w].size == n && std::memcmp(word_names[w].text, p, n) == 0) return w;
  return w_other;
}

// UTF-8 as Python decodes a pickled str ('surrogatepass': encoded surrogates are accepted; no
// overlong forms, nothing past U+10FFFF).
bool valid_utf8(const unsigned char* p, std::uint64_t n) {
  std::uint64_t i = 0;
  constexpr std::uint64_t highs = 0x8080808080808080ull;
  while (i < n) {
    if (i + 8 <= n) {
      std::uint64_t x;
      std::memcpy(&x, p + i, 8);
      if ((x & highs) == 0) {
        i += 8;
        continue;
      }
    }
    unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len;
    if (detail::utf8_sequence(p + i, n - i, /*surrogates=*/true, len) != detail::Utf8::ok)
      return false;
    i += len;
  }
  return true;
}

inline std::uint64_t le(const unsigned char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

const char* opcode_name(unsigned char op) {
  switch (op) {
    case 'c': return "GLOBAL";
    case 0x93: return "STACK_GLOBAL";
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 'R': return "REDUCE";
    case 0x81: return "NEWOBJ";
    case 0x92: return "NEWOBJ_EX";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 'X': return "BINUNICODE";
    case 0x8d: return "BINUNICODE8";
    case 'T': return "BINSTRING";
    case 'B': return "BINBYTES";
    case 0x8e: return "BINBYTES8";
    case 0x96: return "BYTEARRAY8";
    case 0x8b: return "LONG4";
    case 0x95: return "FRAME";
    case 'r': return "LONG_BINPUT";
    case 'q': return "BINPUT";
    case 0x94: return "MEMOIZE";
    default: return "opcode";
  }
}

std::string thousands(std::uint64_t v) {
  std::string digits = std::to_string(v), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

PickleReader::PickleReader(std::uint64_t limit) : limit_(limit) {
  runs_.push_back(PickleRun());  // run 0 means "none"
}

PickleReader::Status PickleReader::fail(const char* what, std::size_t at) {
  error_ = "not a PyTorch memory snapshot: ";
  error_ += what;
  error_ += " (byte " + std::to_string(base_ + at) + ")";
  return status_ = Status::error;
}

PickleReader::Status PickleReader::refuse(unsigned char op, std::size_t at,
                                          std::string_view module, std::string_view name) {
  error_ = "not a PyTorch memory snapshot: refusing to load ";
  if (!module.empty() || !name.empty()) {
    error_.append(module.substr(0, 100)).append(".").append(name.substr(0, 100));
  } else {
    error_ += "a class or call a function";
  }
  error_ += " (" + std::string(opcode_name(op)) + " at byte " + std::to_string(base_ + at) +
            "): a memory snapshot holds plain data only, and this could run code";
  return status_ = Status::error;
}

PickleReader::Status PickleReader::too_long(unsigned char op, std::size_t at, std::uint64_t size) {
  error_ = "the snapshot asks for " + thousands(size) + " more bytes (" + opcode_name(op) +
           " at byte " + std::to_string(base_ + at) + "), past vmalloc's limit of " +
           thousands(limit_) + " bytes: refusing to read it";
  return status_ = Status::error;
}

PickleValue& PickleReader::push(PickleValue::Kind kind, std::uint64_t v) {
  // Built in place: a value assembled beside and then copied in is read back as 16 bytes
  // from smaller stores, a stall on every opcode.
  stack_.emplace_back();
  PickleValue& x = stack_.back();
  x.kind = kind;
  x.v = v;
  x.hashable = kind != PickleValue::list && kind != PickleValue::dict &&
               kind != PickleValue::set && kind != PickleValue::bytearray;
  return x;
}

std::uint64_t PickleReader::new_container() {
  containers_.push_back(PickleContainer());
  return containers_.size() - 1;
}

std::uint64_t PickleReader::new_blob(const unsigned char* p, std::uint64_t n) {
  blobs_.push_back({chars_.size(), n});
  chars_.append(reinterpret_cast<const char*>(p), n);
  return blobs_.size() - 1;
}

void PickleReader::add(std::uint64_t c, std::size_t from) {
  std::size_t n = stack_.size() - from;
  PickleContainer& box = containers_[c];
  if (box.dropped) {  // counted, not kept
    box.count += n;
    stack_.resize(from);
    return;
  }
  PickleRun& tail = runs_[box.last];
  if (box.last != 0 && tail.start + tail.count == values_.size()) {
    tail.count += n;  // the container's last run ends the arena: extend it in place
  } else {
    PickleRun run;
    run.start = values_.size();
    run.count = n;
    std::uint64_t r = runs_.size();
    runs_.push_back(run);
    if (box.last != 0) runs_[box.last].next = r;
    else box.first = r;
    box.last = r;
  }
  box.count += n;
  for (std::size_t i = from; i < stack_.size(); ++i) values_.push_back(stack_[i]);
  stack_.resize(from);
}

namespace {

// `v` as the snapshot reader's u64(): an int (not a bool) in [0, 2**64).
inline bool u64_value(const PickleValue& v, std::uint64_t& out) {
  if (v.kind == PickleValue::big_unsigned ||
      (v.kind == PickleValue::integer && static_cast<std::int64_t>(v.v) >= 0)) {
    out = v.v;
    return true;
  }
  out = 0;
  return false;
}

}  // namespace

std::uint32_t PickleReader::action_id(const PickleValue& str) {
  if (str.word == w_alloc) return 0;
  if (str.word == w_free_requested) return 1;
  if (str.word == w_free_completed) return 2;
  std::string name(blob(str));
  auto [it, inserted] = action_ids_.try_emplace(name, static_cast<std::uint32_t>(actions_.size()));
  if (inserted) actions_.push_back(std::move(name));
  return it->second;
}

void PickleReader::drop(const PickleValue& value) {
  // The values of a list made just before (its one run ends the arena) are dropped: a history
  // entry's stack frames, a reference each, were most of a real snapshot's tree.
  if (value.kind != PickleValue::list) return;
  PickleContainer& list = containers_[value.v];
  if (list.first == 0 || list.first != list.last) return;
  const PickleRun& run = runs_[list.first];
  if (run.start + run.count != values_.size()) return;
  values_.truncate(run.start);
  list.dropped = 1;
}

void PickleReader::set_items(std::uint64_t c, std::size_t from) {
  PickleContainer& box = containers_[c];
  if (!box.compact && box.count == 0) {
    for (std::size_t i = from; i < stack_.size(); i += 2) {
      if (stack_[i].kind == PickleValue::str && stack_[i].word == w_action) {
        box.compact = 1;  // a history entry: kept as its summary
        box.first = entries_.size();
        entries_.push_back(SnapshotEntry());
        break;
      }
    }
  }
  if (!box.compact) {
    add(c, from);
    return;
  }
  SnapshotEntry& e = entries_[box.first];
  for (std::size_t i = from; i < stack_.size(); i += 2) {
    const PickleValue& key = stack_[i];
    const PickleValue& value = stack_[i + 1];
    std::uint8_t bit;
    switch (key.kind == PickleValue::str ? key.word : std::uint8_t{w_other}) {
      case w_action:
        if (value.kind == PickleValue::str) {
          e.action = action_id(value);
          e.flags |= SnapshotEntry::has_action;
        } else {
          e.flags &= static_cast<std::uint8_t>(~SnapshotEntry::has_action);
        }
        continue;
      case w_addr: bit = u64_value(value, e.addr) ? SnapshotEntry::addr_ok : 0; break;
      case w_size: bit = u64_value(value, e.size) ? SnapshotEntry::size_ok : 0; break;
      case w_stream: bit = u64_value(value, e.stream) ? SnapshotEntry::stream_ok : 0; break;
      default:
        drop(value);
        continue;
    }
    std::uint8_t mask = key.word == w_addr   ? SnapshotEntry::addr_ok
                        : key.word == w_size ? SnapshotEntry::size_ok
                                             : SnapshotEntry::stream_ok;
    e.flags = static_cast<std::uint8_t>((e.flags & ~mask) | bit);
  }
  box.count += stack_.size() - from;
  stack_.resize(from);
}

PickleReader::Status PickleReader::memo_bomb(std::uint64_t index, std::size_t at) {
  return fail(("memo index " + std::to_string(index) + " is far beyond the " +
               std::to_string(puts_) +
               " values stored so far (a pickle Python writes numbers them in order)")
                  .c_str(),
              at);
}

bool PickleReader::put(std::uint64_t index, std::size_t at, Status& status) {
  if (stack_.size() <= fence()) return false;  // stack underflow
  if (index >= memo_.size()) {
    if (index > 2 * puts_ + memo_slack) {
      status = memo_bomb(index, at);
      return false;
    }
    memo_.grow_to(index + 1);
  }
  if (memo_[index].kind == PickleValue::unset) ++memo_len_;
  memo_[index] = stack_.back();
  ++puts_;
  return true;
}

const PickleValue* PickleReader::find(const PickleValue& dict, Word word) const {
  const PickleValue* found = nullptr;
  if (containers_[dict.v].compact) return nullptr;
  for (std::uint64_t r = containers_[dict.v].first; r != 0; r = runs_[r].next) {
    const PickleRun& run = runs_[r];
    for (std::uint64_t i = 0; i + 1 < run.count; i += 2) {
      const PickleValue& k = values_[run.start + i];
      if (k.kind == PickleValue::str && k.word == word) found = &values_[run.start + i + 1];
    }
  }
  return found;
}

bool PickleReader::truthy(const PickleValue& v) const {
  switch (v.kind) {
    case PickleValue::none: return false;
    case PickleValue::boolean:
    case PickleValue::integer:
    case PickleValue::big_unsigned: return v.v != 0;
    case PickleValue::big_integer: return true;  // kept only when it does not fit 64 bits
    case PickleValue::floating: {
      double d;
      std::memcpy(&d, &v.v, 8);
      return d != 0;  // NaN is true
    }
    case PickleValue::str:
    case PickleValue::bytes:
    case PickleValue::bytearray: return blobs_[v.v].size != 0;
    case PickleValue::unset: return false;
    default: return containers_[v.v].count != 0;
  }
}

std::uint64_t PickleReader::memory() const {
  return buf_.capacity() + stack_.capacity() * sizeof(PickleValue) +
         marks_.capacity() * sizeof(std::size_t) + memo_.memory() + values_.memory() +
         runs_.memory() + containers_.memory() + blobs_.memory() + chars_.capacity() +
         entries_.memory();
}

void PickleReader::clear() {
  std::string().swap(buf_);
  std::vector<PickleValue>().swap(stack_);
  std::vector<std::size_t>().swap(marks_);
  memo_.clear();
  values_.clear();
  runs_.clear();
  containers_.clear();
  blobs_.clear();
  std::string().swap(chars_);
  entries_.clear();
  root_ = PickleValue();
}

PickleReader::Status PickleReader::feed(const char* data, std::size_t n) {
  // In steps of 64 KiB, so that the memory bound is checked every few thousand opcodes.
  constexpr std::size_t step = 64u << 10;
  while (status_ == Status::more && n > 0) {
    std::size_t k = n < step ? n : step;
    received_ += k;
    if (stopped_) {  // only waiting for the end of the last frame
      if (received_ >= frame_end_) status_ = Status::done;
    } else if (scanning_) {
      if (pos_ > 0) {
        buf_.erase(0, pos_);
        base_ += pos_;
        pos_ = 0;
      }
      std::size_t drop = skip_ < k ? static_cast<std::size_t>(skip_) : k;  // a payload's rest
      skip_ -= drop;
      base_ += drop;
      buf_.append(data + drop, k - drop);
      scan();
    } else {
      if (pos_ > 0) {
        buf_.erase(0, pos_);
        base_ += pos_;
        pos_ = 0;
      }
      buf_.append(data, k);
      if (run() == Status::more && memory() > memory_budget(received_)) {
        error_ = "refusing to read this pickle: its structure would take more than " +
                 thousands(memory_budget(received_)) + " bytes of memory after " +
                 thousands(received_) + " bytes of pickle (byte " + std::to_string(base_ + pos_) +
                 "), several times what a PyTorch memory snapshot of its size takes";
        status_ = Status::error;
      }
    }
    data += k;
    n -= k;
  }
  return status_;
}

PickleReader::Status PickleReader::finish() {
  if (status_ != Status::more) return status_;
  eof_ = true;
  if (stopped_) return status_ = Status::bail;  // the last frame is cut: Python says so
  if (scanning_) scan();
  else run();
  if (status_ == Status::more) status_ = Status::bail;  // truncated
  return status_;
}

PickleReader::Status PickleReader::scan() {
  // Each opcode as CPython's unpickler reads it: the opcode, then its arguments, each read
  // from the frame being read while it holds them, else (the frame's rest dropped) from the
  // file. No value is made: only the memo indices are checked, and Python's unpickler is
  // left to stop where it stops (at STOP, an unknown opcode, a class, ...).
  const unsigned char* d = reinterpret_cast<const unsigned char*>(buf_.data());
  const std::size_t n = buf_.size();
  constexpr std::size_t max_line = 1u << 20;  // Python's bound on a text line read from the file
  for (;;) {
    std::size_t p = pos_;
    std::uint64_t fl = frame_left_;
    bool here = true;  // every byte looked at is in the buffer
    auto step = [&](std::uint64_t k) {  // a read of k bytes; false: not here yet
      if (fl > 0 && k > fl) {
        p += fl;  // the frame's rest is dropped
        fl = 0;
      } else if (fl > 0) {
        fl -= k;
      }
      std::size_t at = p;
      p += k;
      if (p > n || p < at) here = false;
      return at;
    };
    std::size_t line_start = 0;
    auto line = [&]() -> int {  // a text argument: 1 read, 0 wait, -1 too long
      line_start = p;
      if (fl > 0) {
        std::uint64_t span = fl < max_line ? fl : max_line;
        std::size_t end = n - p < span ? n : p + static_cast<std::size_t>(span);
        const void* nl = std::memchr(d + p, '\n', end - p);
        if (nl != nullptr) {
          std::size_t len = static_cast<const unsigned char*>(nl) - (d + p) + 1;
          fl -= len;
          p += len;
          return 1;
        }
        if (n - p < span) return 0;
        if (fl > max_line) return -1;
        p += fl;  // no newline in the frame's rest: dropped, the line read from the file
        fl = 0;
        line_start = p;
      }
      std::size_t end = n - p > max_line ? p + max_line : n;
      const void* nl = p < n ? std::memchr(d + p, '\n', end - p) : nullptr;
      if (nl == nullptr) return n - p >= max_line ? -1 : 0;
      p = static_cast<const unsigned char*>(nl) - d + 1;
      return 1;
    };
    auto commit = [&]() {
      frame_left_ = fl;
      if (p > n) {  // a payload past the buffer: dropped as it comes
        skip_ = p - n;
        p = n;
      }
      pos_ = p;
    };
    auto wait = [&]() { return status_ = eof_ ? Status::bail : Status::more; };
    // PUT's argument as Python's int() might read it (signs, spaces and underscores
    // aside): its digits; false for a negative one (an error there).
    auto decimal = [&](std::size_t b, std::size_t e, std::uint64_t& v) {
      v = 0;
      for (; b < e; ++b) {
        if (d[b] == '-') return false;
        unsigned digit = d[b] - '0';
        if (digit > 9) continue;
        v = v > (UINT64_MAX - digit) / 10 ? UINT64_MAX : v * 10 + digit;
      }
      return true;
    };
    if (p >= n) return wait();
    std::size_t at = step(1);
    const unsigned char op = d[at];
    switch (op) {
      case '.':  // STOP: Python's unpickler reads no further
        return status_ = Status::bail;
      case 'q': case 'r': case 'h': case 'j': case 'J': case 'K': case 'M': case 'G':
      case 0x80: case 0x82: case 0x83: case 0x84: case 0x95: {
        std::uint64_t k = op == 'q' || op == 'h' || op == 'K' || op == 0x80 || op == 0x82 ? 1
                          : op == 'M' || op == 0x83 ? 2
                          : op == 'G' || op == 0x95 ? 8 : 4;
        std::size_t arg = step(k);
        if (!here) return wait();
        std::uint64_t v = le(d + arg, static_cast<int>(k));
        if (op == 'q' || op == 'r') {
          if (v > 2 * puts_ + memo_slack) return memo_bomb(v, at);
          ++puts_;
        } else if (op == 0x80 && v > highest_protocol) {
          return status_ = Status::bail;  // Python stops here
        } else if (op == 0x95) {
          if (static_cast<std::int64_t>(v) < 0) return status_ = Status::bail;
          if (v > fl) {  // a new frame, read from the file (the rest of one being read dropped)
            p += fl;
            fl = v;
          }
        }
        commit();
        break;
      }
      case 0x94:  // MEMOIZE
        ++puts_;
        commit();
        break;
      case 0x8a: case 0x8b: case 'U': case 'T': case 0x8c: case 'X': case 0x8d: case 'C':
      case 'B': case 0x8e: case 0x96: {  // a length, then as many bytes
        std::uint64_t k = op == 0x8a || op == 'U' || op == 0x8c || op == 'C' ? 1
                          : op == 0x8d || op == 0x8e || op == 0x96 ? 8 : 4;
        std::size_t arg = step(k);
        if (!here) return wait();
        std::uint64_t size = le(d + arg, static_cast<int>(k));
        if ((op == 0x8b || op == 'T') && static_cast<std::int32_t>(size) < 0)
          return status_ = Status::bail;
        if (size > limit_) return status_ = Status::bail;  // refused by the reader's limit
        if (fl > 0 && size > fl) {
          p += fl;
          fl = 0;
        } else if (fl > 0) {
          fl -= size;
        }
        p += size;
        commit();
        break;
      }
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'g': case 'p': {  // a text line
        int r = line();
        if (r < 0) return fail("a text argument longer than 1 MiB", at);
        if (r == 0) return wait();
        if (op == 'p') {
          std::uint64_t v;
          if (!decimal(line_start, p - 1, v)) return status_ = Status::bail;  // Python's error
          if (v > 2 * puts_ + memo_slack) return memo_bomb(v, at);
          ++puts_;
        }
        commit();
        break;
      }
      case '(': case '0': case '1': case '2': case 'N': case 0x88: case 0x89: case ']': case '}':
      case ')': case 0x8f: case 'l': case 't': case 'd': case 0x91: case 0x85: case 0x86:
      case 0x87: case 'a': case 'e': case 's': case 'u': case 0x90: case 'b':
        commit();
        break;
      default:  // a class, a call, an out-of-band buffer, an unknown byte: Python stops here
        return status_ = Status::bail;
    }
  }
}

PickleReader::Status PickleReader::run() {
  const unsigned char* d = reinterpret_cast<const unsigned char*>(buf_.data());
  const std::size_t n = buf_.size();
  std::size_t p = pos_;
  // Bytes the opcode at p needs: if they are not here yet, wait for the next block (or, at the
  // end of the file, let Python's unpickler word the truncation).
#define NEED(k)                                                \
  do {                                                         \
    if (n - p < static_cast<std::size_t>(k)) {                 \
      pos_ = p;                                                \
      frame_left_ = frame_left;                                \
      return status_ = eof_ ? Status::bail : Status::more;     \
    }                                                          \
  } while (0)
  // Not decided here: the rest of the stream is scanned for hostile opcodes before Python's
  // unpickler reads the file (scan()), from this opcode on.
#define BAIL()                        \
  do {                                \
    pos_ = p;                         \
    frame_left_ = frame_left;         \
    scanning_ = true;                 \
    return scan();                    \
  } while (0)
  // One read of an opcode's argument, once all its bytes are here (see take()).
#define TAKE(k)                 \
  do {                          \
    if (!take(k)) BAIL();       \
  } while (0)
  // A length-prefixed argument: refused before it is buffered if it passes the limit.
#define LENGTH(header, size)                                                          \
  do {                                                                                \
    std::uint64_t avail_ = limit_ > base_ + p + (header) ? limit_ - base_ - p - (header) : 0; \
    if ((size) > avail_) {                                                            \
      pos_ = p;                                                                       \
      return too_long(op, p, size);                                                   \
    }                                                                                 \
    NEED((header) + (size));                                                          \
  } while (0)

  for (;;) {
    if (p >= n) {
      pos_ = p;
      if (base_ + p > limit_) {
        error_ = "the snapshot is larger than vmalloc's limit of " + thousands(limit_) +
                 " bytes (decompressed): refusing to read it";
        return status_ = Status::error;
      }
      return status_ = eof_ ? Status::bail : Status::more;
    }
    const unsigned char op = d[p];
    const std::uint64_t frame_left = frame_left_;  // restored where the opcode must wait
    take(1);  // the opcode: one byte never crosses a frame's end
    switch (op) {
      case 0x80: {  // PROTO
        NEED(2);
        TAKE(1);
        if (d[p + 1] > highest_protocol) BAIL();
        p += 2;
        break;
      }
      case 0x95: {  // FRAME: CPython reads the whole frame at once; its opcodes follow
        NEED(9);
        TAKE(8);
        std::uint64_t size = le(d + p + 1, 8);
        if (frame_left_ == 0) {
          std::uint64_t avail = limit_ > base_ + p + 9 ? limit_ - base_ - p - 9 : 0;
          if (size > avail) return too_long(op, p, size);
          frame_end_ = base_ + p + 9 + size;
          frame_left_ = size;
        } else if (size > frame_left_) {
          BAIL();  // a frame inside a frame that it passes: CPython drops the first's rest
        }  // else within the frame being read: CPython reads nothing
        p += 9;
        break;
      }
      case '.': {  // STOP
        if (stack_.size() <= fence()) BAIL();
        root_ = stack_.back();
        pos_ = p + 1;
        stopped_ = true;
        status_ = received_ >= frame_end_ ? Status::done : Status::more;
        if (status_ == Status::more && eof_) status_ = Status::bail;
        return status_;
      }
      case '(':  // MARK
        marks_.push_back(stack_.size());
        ++p;
        break;
      case '0':  // POP: a MARK on top goes first
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();
        } else {
          if (stack_.size() <= fence()) BAIL();
          stack_.pop_back();
        }
        ++p;
        break;
      case '1':  // POP_MARK
        if (marks_.empty()) BAIL();
        stack_.resize(marks_.back());
        marks_.pop_back();
        ++p;
        break;
      case '2':  // DUP
        if (stack_.size() <= fence()) BAIL();
        stack_.push_back(stack_.back());
        ++p;
        break;
      case 'N':
        push(PickleValue::none, 0);
        ++p;
        break;
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
        push(PickleValue::boolean, op == 0x88);
        ++p;
        break;
      case 'J': {  // BININT
        NEED(5);
        TAKE(4);
        push(PickleValue::integer, static_cast<std::uint64_t>(static_cast<std::int64_t>(
                                       static_cast<std::int32_t>(le(d + p + 1, 4)))));
        p += 5;
        break;
      }
      case 'K':    // BININT1
      case 'M': {  // BININT2
        int k = op == 'K' ? 1 : 2;
        NEED(1 + k);
        TAKE(k);
        push(PickleValue::integer, le(d + p + 1, k));
        p += 1 + k;
        break;
      }
      case 0x8a:    // LONG1
      case 0x8b: {  // LONG4
        std::size_t header = op == 0x8a ? 2 : 5;
        NEED(header);
        std::uint64_t size;
        if (op == 0x8a) {
          size = d[p + 1];
        } else {
          std::int64_t s = static_cast<std::int32_t>(le(d + p + 1, 4));
          if (s < 0) BAIL();  // "LONG pickle has negative byte count"
          size = static_cast<std::uint64_t>(s);
          LENGTH(header, size);
        }
        NEED(header + size);
        TAKE(header - 1);
        TAKE(size);
        const unsigned char* b = d + p + header;
        // The value, whatever the encoding's length: drop the redundant sign bytes.
        std::uint64_t len = size;
        bool negative = len && (b[len - 1] & 0x80);
        while (len > 1 && b[len - 1] == (negative ? 0xFF : 0x00) &&
               ((b[len - 2] & 0x80) != 0) == negative)
          --len;
        if (len == 0) {
          push(PickleValue::integer, 0);
        } else if (len <= 8) {
          std::uint64_t x = le(b, static_cast<int>(len));
          if (negative && len < 8) x |= ~std::uint64_t{0} << (8 * len);
          push(PickleValue::integer, x);
        } else if (len == 9 && !negative && b[8] == 0) {
          push(PickleValue::big_unsigned, le(b, 8));  // [2**63, 2**64)
        } else {
          push(PickleValue::big_integer, new_blob(b, len));
        }
        p += header + size;
        break;
      }
      case 'G': {  // BINFLOAT: big-endian
        NEED(9);
        TAKE(8);
        std::uint64_t bits = 0;
        for (int i = 1; i <= 8; ++i) bits = (bits << 8) | d[p + i];
        push(PickleValue::floating, bits);
        p += 9;
        break;
      }
      case 0x8c:  // SHORT_BINUNICODE
      case 'X':   // BINUNICODE
      case 0x8d:  // BINUNICODE8
      case 'U':   // SHORT_BINSTRING (a Python 2 str: decoded as ASCII)
      case 'T':   // BINSTRING
      case 'C':   // SHORT_BINBYTES
      case 'B':   // BINBYTES
      case 0x8e:  // BINBYTES8
      case 0x96: {  // BYTEARRAY8
        int k = (op == 0x8c || op == 'U' || op == 'C') ? 1
                : (op == 0x8d || op == 0x8e || op == 0x96) ? 8 : 4;
        NEED(1 + k);
        std::uint64_t size = le(d + p + 1, k);
        if (op == 'T' && static_cast<std::int32_t>(size) < 0) BAIL();  // negative byte count
        LENGTH(1 + static_cast<std::size_t>(k), size);
        TAKE(k);
        TAKE(size);
        const unsigned char* b = d + p + 1 + k;
        if (op == 0x8c || op == 'X' || op == 0x8d) {
          if (!valid_utf8(b, size)) BAIL();
          push(PickleValue::str, new_blob(b, size)).word = word_of(b, size);
        } else if (op == 'U' || op == 'T') {
          for (std::uint64_t i = 0; i < size; ++i)
            if (b[i] >= 0x80) BAIL();
          push(PickleValue::str, new_blob(b, size)).word = word_of(b, size);
        } else {
          push(op == 0x96 ? PickleValue::bytearray : PickleValue::bytes, new_blob(b, size));
        }
        p += 1 + k + size;
        break;
      }
      case ']':  // EMPTY_LIST
        push(PickleValue::list, new_container());
        ++p;
        break;
      case '}':  // EMPTY_DICT
        push(PickleValue::dict, new_container());
        ++p;
        break;
      case ')':  // EMPTY_TUPLE
        push(PickleValue::tuple, new_container());
        ++p;
        break;
      case 0x8f:  // EMPTY_SET
        push(PickleValue::set, new_container());
        ++p;
        break;
      case 'l':     // LIST
      case 't':     // TUPLE
      case 'd':     // DICT
      case 0x91: {  // FROZENSET
        if (marks_.empty()) BAIL();  // "could not find MARK"
        std::size_t from = marks_.back();
        marks_.pop_back();
        PickleValue::Kind kind = op == 'l' ? PickleValue::list
                                 : op == 't' ? PickleValue::tuple
                                 : op == 'd' ? PickleValue::dict : PickleValue::frozenset;
        if (kind == PickleValue::dict) {
          if ((stack_.size() - from) % 2) BAIL();
          for (std::size_t i = from; i < stack_.size(); i += 2)
            if (!stack_[i].hashable) BAIL();
        }
        bool all_hashable = true;
        for (std::size_t i = from; i < stack_.size(); ++i) all_hashable &= stack_[i].hashable;
        if (kind == PickleValue::frozenset && !all_hashable) BAIL();
        std::uint64_t c = new_container();
        if (stack_.size() > from) {
          if (kind == PickleValue::dict) set_items(c, from);
          else add(c, from);
        }
        PickleValue& v = push(kind, c);
        if (kind == PickleValue::tuple) v.hashable = all_hashable;
        ++p;
        break;
      }
      case 0x85:    // TUPLE1
      case 0x86:    // TUPLE2
      case 0x87: {  // TUPLE3
        std::size_t k = op - 0x84u;
        if (stack_.size() < k || stack_.size() - k < fence()) BAIL();
        std::size_t from = stack_.size() - k;
        bool all_hashable = true;
        for (std::size_t i = from; i < stack_.size(); ++i) all_hashable &= stack_[i].hashable;
        std::uint64_t c = new_container();
        add(c, from);
        push(PickleValue::tuple, c).hashable = all_hashable;
        ++p;
        break;
      }
      case 'a':     // APPEND
      case 'e':     // APPENDS
      case 's':     // SETITEM
      case 'u':     // SETITEMS
      case 0x90: {  // ADDITEMS
        std::int64_t x;
        if (op == 'a' || op == 's') {
          x = static_cast<std::int64_t>(stack_.size()) - (op == 'a' ? 1 : 2);
        } else {
          if (marks_.empty()) BAIL();
          x = static_cast<std::int64_t>(marks_.back());
          marks_.pop_back();
        }
        std::int64_t len = static_cast<std::int64_t>(stack_.size());
        if (x > len || x <= static_cast<std::int64_t>(fence())) BAIL();  // underflow
        if (x < len) {  // APPENDS of nothing does not look at its target
          const PickleValue target = stack_[static_cast<std::size_t>(x) - 1];
          std::size_t from = static_cast<std::size_t>(x);
          if (op == 'a' || op == 'e') {
            if (target.kind != PickleValue::list) BAIL();
          } else if (op == 0x90) {
            if (target.kind != PickleValue::set) BAIL();
            for (std::size_t i = from; i < stack_.size(); ++i)
              if (!stack_[i].hashable) BAIL();
          } else {
            if (target.kind != PickleValue::dict || (len - x) % 2) BAIL();
            for (std::size_t i = from; i < stack_.size(); i += 2)
              if (!stack_[i].hashable) BAIL();
          }
          if (op == 's' || op == 'u') set_items(target.v, from);
          else add(target.v, from);
        }
        ++p;
        break;
      }
      case 'q':     // BINPUT
      case 'r':     // LONG_BINPUT
      case 0x94: {  // MEMOIZE
        int k = op == 'q' ? 1 : op == 'r' ? 4 : 0;
        NEED(1 + k);
        TAKE(k);
        std::uint64_t index = k ? le(d + p + 1, k) : memo_len_;
        Status s = Status::more;
        if (!put(index, p, s)) {
          pos_ = p;
          if (s == Status::error) return s;
          BAIL();
        }
        p += 1 + k;
        break;
      }
      case 'h':    // BINGET
      case 'j': {  // LONG_BINGET
        int k = op == 'h' ? 1 : 4;
        NEED(1 + k);
        TAKE(k);
        std::uint64_t index = le(d + p + 1, k);
        if (index >= memo_.size() || memo_[index].kind == PickleValue::unset) BAIL();
        stack_.push_back(memo_[index]);
        p += 1 + k;
        break;
      }
      case 'c':    // GLOBAL module\nname\n
      case 'i': {  // INST module\nname\n
        std::string_view rest(reinterpret_cast<const char*>(d + p + 1), n - p - 1);
        rest = rest.substr(0, 512);
        std::size_t a = rest.find('\n');
        std::size_t b = a == std::string_view::npos ? a : rest.find('\n', a + 1);
        if (b == std::string_view::npos) {
          if (rest.size() < 512 && !eof_) {  // the names may be in the next block
            pos_ = p;
            frame_left_ = frame_left;
            return status_ = Status::more;
          }
          return refuse(op, p, {}, {});
        }
        return refuse(op, p, rest.substr(0, a), rest.substr(a + 1, b - a - 1));
      }
      case 0x93: {  // STACK_GLOBAL: module and name are the two strings on the stack
        if (stack_.size() >= 2 && stack_[stack_.size() - 2].kind == PickleValue::str &&
            stack_.back().kind == PickleValue::str)
          return refuse(op, p, blob(stack_[stack_.size() - 2]), blob(stack_.back()));
        return refuse(op, p, {}, {});
      }
      case 'o':     // OBJ
      case 'R':     // REDUCE
      case 0x81:    // NEWOBJ
      case 0x92:    // NEWOBJ_EX
      case 0x82:    // EXT1
      case 0x83:    // EXT2
      case 0x84:    // EXT4
      case 'P':     // PERSID
      case 'Q':     // BINPERSID
        return refuse(op, p, {}, {});
      default:
        // Protocol 0 text opcodes (INT, LONG, FLOAT, STRING, UNICODE, PUT, GET), BUILD (a
        // no-op on plain data in some cases), out-of-band buffers, unknown bytes: Python's
        // unpickler decides.
        BAIL();
    }
  }
#undef NEED
#undef BAIL
#undef TAKE
#undef LENGTH
}

}  // namespace vmalloc::trace_parse
