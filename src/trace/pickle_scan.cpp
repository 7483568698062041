// The restricted unpickler's scan after a bail (see include/vmalloc/trace/pickle_reader.hpp):
// once the reader leaves a stream to Python's unpickler, the rest is read opcode by opcode,
// without building values, for what would make that unpickler run out of memory (memo bombs).
#include "vmalloc/trace/detail/pickle_bytes.hpp"
#include "vmalloc/trace/pickle_reader.hpp"

namespace vmalloc::trace_parse {

using detail::highest_protocol;
using detail::le;
using detail::memo_slack;

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

}  // namespace vmalloc::trace_parse
