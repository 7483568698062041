// The C++ reader of RMM logging CSVs, for vmalloc/traces/_trace_parse.pyx.
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
#include <vector>

#include "vmalloc/trace/detail/records.hpp"

namespace vmalloc::trace_parse {

// rmm.mr.LoggingResourceAdaptor's CSV (vmalloc/traces/rmm_csv.py).
class RmmCsvParser {
 public:
  bool feed(const char* data, std::size_t n, Events& out);
  bool finish(Events& out);  // end of file
  const std::vector<std::string>& columns() const { return columns_; }
  std::uint64_t allocate_failures() const { return failures_; }

 private:
  VMALLOC_TRACE_PARSE_INTERNAL bool line(const char* b, const char* e, Events& out);
  VMALLOC_TRACE_PARSE_INTERNAL bool header(const char* b, const char* e);
  std::string carry_;
  bool have_header_ = false;
  std::vector<std::string> columns_;
  std::size_t i_action_ = 0, i_pointer_ = 0, i_size_ = 0, width_ = 0;
  long i_stream_ = -1;
  std::uint64_t failures_ = 0;
};

}  // namespace vmalloc::trace_parse
