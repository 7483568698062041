// Writes vmalloc's trace format, .vmtrace, in its raw encoding: a 32-byte header and one
// 32-byte record per event (the layout of vmalloc.traces.events.EVENT_DTYPE), little-endian.
// docs/trace_formats.rst specifies the format; vmalloc/traces/vmtrace.py reads it.
//
// Records are buffered and written in large blocks; the event count goes into the header on
// close(), so a file cut short by a crash still reads (its count stays "unknown"). Not
// thread-safe: the owner serializes calls (LoggingAllocator holds its mutex).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace vmalloc {

class VmtraceWriter {
 public:
  static constexpr std::uint8_t op_alloc = 0;  // vmalloc.traces.events.ALLOC
  static constexpr std::uint8_t op_free = 1;   // vmalloc.traces.events.FREE

  // Creates (truncates) `path` and writes the header. `consistent` promises that every FREE
  // names a live address with its allocation's size and that no ALLOC names a live address;
  // `metadata_json` is a JSON object stored in the header ("" for none). Throws
  // InvalidArgument naming the path when the file cannot be created.
  VmtraceWriter(const std::string& path, bool consistent, const std::string& metadata_json);
  // Closes the file; a failure here is lost (call close() to see it).
  ~VmtraceWriter();
  VmtraceWriter(const VmtraceWriter&) = delete;
  VmtraceWriter& operator=(const VmtraceWriter&) = delete;

  // Buffers one event; writes the buffer when full. Throws Error on a write failure.
  void append(std::uint8_t op, std::uint64_t stream, std::uint64_t addr, std::uint64_t size);
  // Writes buffered events and flushes the file. Throws Error on a write failure.
  void flush();
  // flush(), the event count into the header, then closes. Idempotent.
  void close();

  bool is_open() const noexcept { return file_ != nullptr; }
  std::uint64_t events() const noexcept { return events_; }
  const std::string& path() const noexcept { return path_; }

 private:
  struct FileCloser {
    void operator()(std::FILE* f) const noexcept { std::fclose(f); }
  };
  void write_bytes(const unsigned char* data, std::size_t n);

  std::string path_;
  std::unique_ptr<std::FILE, FileCloser> file_;
  std::vector<unsigned char> buffer_;
  std::uint64_t events_ = 0;
};

}  // namespace vmalloc
