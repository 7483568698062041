// The restricted unpickler: see include/vmalloc/trace/pickle_reader.hpp. The stream (feed,
// finish) and the opcodes (run): each follows CPython's C unpickler (Modules/_pickle.c),
// where it bails out instead of raising. The values they build are pickle_values.cpp's; the
// scan that follows a bail is pickle_scan.cpp.
#include <cstring>

#include "vmalloc/trace/detail/pickle_bytes.hpp"
#include "vmalloc/trace/detail/utf8.hpp"
#include "vmalloc/trace/pickle_reader.hpp"

namespace vmalloc::trace_parse {

using detail::highest_protocol;
using detail::le;
using detail::memo_slack;
using detail::thousands;
using detail::word_of;

namespace {

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

}  // namespace

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
