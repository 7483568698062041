// The RMM logging CSV reader: see include/vmalloc/trace/rmm_csv.hpp. It mirrors
// vmalloc/traces/rmm_csv.py; where the two could differ it bails out instead.
#include "vmalloc/trace/rmm_csv.hpp"

#include <cstring>

namespace vmalloc::trace_parse {

using detail::make_event;
namespace {

// The longest line of an RMM log taken here (csv's field limit is 131,072 characters).
constexpr std::size_t max_csv_line = 100000;

// Bytes that make an RMM line "odd": control characters but tab, quotes, non-ASCII.
struct CsvTable {
  bool odd[256];
  CsvTable() {
    for (int c = 0; c < 256; ++c) odd[c] = (c < 0x20 && c != '\t') || c == '"' || c >= 0x80;
  }
};
const CsvTable csv_table;

inline void trim(const char*& b, const char*& e) {
  while (b < e && (*b == ' ' || *b == '\t')) ++b;
  while (e > b && (e[-1] == ' ' || e[-1] == '\t')) --e;
}

bool eq_lower(const char* b, const char* e, const char* word) {
  std::size_t n = std::strlen(word);
  if (static_cast<std::size_t>(e - b) != n) return false;
  for (std::size_t i = 0; i < n; ++i) {
    char c = b[i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != word[i]) return false;
  }
  return true;
}

// rmm_csv._hex: [0x]hex digits (any number of leading zeros) up to 2**64 - 1, or a null word.
bool parse_hex(const char* b, const char* e, std::uint64_t& value) {
  trim(b, e);
  if (eq_lower(b, e, "(nil)") || eq_lower(b, e, "nil") || eq_lower(b, e, "null") ||
      eq_lower(b, e, "nullptr")) {
    value = 0;
    return true;
  }
  if (e - b >= 2 && b[0] == '0' && (b[1] == 'x' || b[1] == 'X')) b += 2;
  if (b == e) return false;
  std::uint64_t v = 0;
  int significant = 0;
  for (; b < e; ++b) {
    int d = detail::hex_digit(static_cast<unsigned char>(*b));
    if (d < 0) return false;
    if (v == 0 && d == 0) continue;
    if (++significant > 16) return false;
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  value = v;
  return true;
}

// rmm_csv._size: decimal digits up to 2**64 - 1.
bool parse_decimal(const char* b, const char* e, std::uint64_t& value) {
  trim(b, e);
  if (b == e) return false;
  std::uint64_t v = 0;
  for (; b < e; ++b) {
    unsigned d = static_cast<unsigned char>(*b) - '0';
    if (d > 9) return false;
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  value = v;
  return true;
}

}  // namespace

bool RmmCsvParser::header(const char* b, const char* e) {
  if (b == e) return false;
  const char* f = b;
  for (const char* p = b;; ++p) {
    if (p == e || *p == ',') {
      const char* fb = f;
      const char* fe = p;
      trim(fb, fe);
      columns_.emplace_back(fb, fe);
      if (p == e) break;
      f = p + 1;
    }
  }
  auto find = [&](const char* name) -> long {
    for (std::size_t i = 0; i < columns_.size(); ++i)
      if (columns_[i] == name) return static_cast<long>(i);
    return -1;
  };
  long a = find("Action"), p = find("Pointer"), s = find("Size");
  if (a < 0 || p < 0 || s < 0) return false;  // the Python reader words the error
  i_action_ = static_cast<std::size_t>(a);
  i_pointer_ = static_cast<std::size_t>(p);
  i_size_ = static_cast<std::size_t>(s);
  i_stream_ = find("Stream");
  long width = std::max(std::max(a, p), std::max(s, i_stream_)) + 1;
  width_ = static_cast<std::size_t>(width);
  have_header_ = true;
  return true;
}

bool RmmCsvParser::line(const char* b, const char* e, Events& out) {
  if (e > b && e[-1] == '\r') --e;
  for (const char* p = b; p < e; ++p)
    if (csv_table.odd[static_cast<unsigned char>(*p)]) return false;
  if (!have_header_) return header(b, e);
  if (b == e) return true;  // a blank line
  // Field boundaries up to the widest column used.
  const char* starts[64];
  const char* ends[64];
  if (width_ > 64) return false;
  std::size_t n = 0;
  const char* f = b;
  for (const char* p = b; n < width_; ++p) {
    if (p == e || *p == ',') {
      starts[n] = f;
      ends[n] = p;
      ++n;
      if (p == e) break;
      f = p + 1;
    }
  }
  if (n < width_) return false;
  const char* ab = starts[i_action_];
  const char* ae = ends[i_action_];
  trim(ab, ae);
  std::size_t alen = static_cast<std::size_t>(ae - ab);
  std::uint8_t op;
  if (alen == 8 && std::memcmp(ab, "allocate", 8) == 0) {
    op = TraceEvent::op_alloc;
  } else if (alen == 4 && std::memcmp(ab, "free", 4) == 0) {
    op = TraceEvent::op_free;
  } else if (alen == 10 && std::memcmp(ab, "deallocate", 10) == 0) {
    op = TraceEvent::op_free;
  } else if (alen == 16 && std::memcmp(ab, "allocate failure", 16) == 0) {
    ++failures_;
    return true;
  } else {
    return false;
  }
  std::uint64_t addr, size, stream = 0;
  if (!parse_hex(starts[i_pointer_], ends[i_pointer_], addr)) return false;
  if (!parse_decimal(starts[i_size_], ends[i_size_], size)) return false;
  if (i_stream_ >= 0 && !parse_hex(starts[i_stream_], ends[i_stream_], stream)) return false;
  out.push_back(make_event(op, stream, addr, size));
  return true;
}

bool RmmCsvParser::feed(const char* data, std::size_t n, Events& out) {
  const char* p = data;
  const char* end = data + n;
  if (!carry_.empty()) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', n));
    if (nl == nullptr) {
      carry_.append(p, n);
      return carry_.size() <= max_csv_line;
    }
    carry_.append(p, nl);
    if (carry_.size() > max_csv_line) return false;
    if (!line(carry_.data(), carry_.data() + carry_.size(), out)) return false;
    carry_.clear();
    p = nl + 1;
  }
  while (p < end) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    if (nl == nullptr) {
      if (static_cast<std::size_t>(end - p) > max_csv_line) return false;
      carry_.assign(p, end);
      break;
    }
    if (static_cast<std::size_t>(nl - p) > max_csv_line) return false;
    if (!line(p, nl, out)) return false;
    p = nl + 1;
  }
  return true;
}

bool RmmCsvParser::finish(Events& out) {
  if (!carry_.empty()) {
    if (!line(carry_.data(), carry_.data() + carry_.size(), out)) return false;
    carry_.clear();
  }
  return have_header_;  // an empty file: the Python reader says so
}

}  // namespace vmalloc::trace_parse
