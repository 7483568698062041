// The restricted unpickler's values (see include/vmalloc/trace/pickle_reader.hpp): the stack,
// containers and their items, the memo, the lookups the snapshot reader makes, and the errors
// worded for the user. The opcodes that build them are in pickle_reader.cpp.
#include <cstring>

#include "vmalloc/trace/detail/pickle_bytes.hpp"
#include "vmalloc/trace/pickle_reader.hpp"

namespace vmalloc::trace_parse {
namespace detail {
namespace {

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

}  // namespace

std::uint8_t word_of(const unsigned char* p, std::uint64_t n) {
  if (n > 20) return w_other;
  for (std::uint8_t w = 1; w < n_words; ++w)
    if (word_names[w].size == n && std::memcmp(word_names[w].text, p, n) == 0) return w;
  return w_other;
}

}  // namespace detail

using detail::memo_slack;
using detail::thousands;

namespace {

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

}  // namespace vmalloc::trace_parse
