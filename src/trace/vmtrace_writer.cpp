#include "vmalloc/trace/vmtrace_writer.hpp"

#include <cerrno>
#include <cstring>

#include "vmalloc/base/errors.hpp"

namespace vmalloc {
namespace {

constexpr unsigned char kMagic[8] = {'V', 'M', 'T', 'R', 'A', 'C', 'E', '\0'};
constexpr std::uint16_t kVersion = 1;
constexpr std::uint16_t kEncodingRaw = 0;
constexpr std::uint32_t kFlagConsistent = 1;
constexpr std::uint64_t kUnknownCount = ~std::uint64_t{0};
constexpr std::size_t kHeaderBytes = 32;
constexpr std::size_t kRecordBytes = 32;
constexpr std::size_t kCountOffset = 16;
constexpr std::size_t kBufferRecords = 4096;  // 128 KiB per write

// Little-endian stores, whatever the host's byte order: the format is little-endian.
void put_le(unsigned char* out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(value >> (8 * i));
}

std::string io_error(const std::string& what, const std::string& path) {
  return what + " trace file '" + path + "': " + std::strerror(errno);
}

}  // namespace

VmtraceWriter::VmtraceWriter(const std::string& path, bool consistent,
                             const std::string& metadata_json)
    : path_(path) {
  if (metadata_json.size() > (1u << 20)) {
    throw InvalidArgument("trace metadata of " + std::to_string(metadata_json.size()) +
                          " bytes is larger than 1 MiB");
  }
  errno = 0;
  file_.reset(std::fopen(path.c_str(), "wb"));
  if (!file_) throw InvalidArgument(io_error("cannot create", path));
  buffer_.reserve(kBufferRecords * kRecordBytes);

  unsigned char header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, sizeof kMagic);
  put_le(header + 8, kVersion, 2);
  put_le(header + 10, kEncodingRaw, 2);
  put_le(header + 12, consistent ? kFlagConsistent : 0, 4);
  put_le(header + kCountOffset, kUnknownCount, 8);
  put_le(header + 24, metadata_json.size(), 4);
  // bytes 28..31 reserved, zero
  write_bytes(header, sizeof header);
  write_bytes(reinterpret_cast<const unsigned char*>(metadata_json.data()), metadata_json.size());
}

VmtraceWriter::~VmtraceWriter() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() explicitly to learn of the failure.
  }
}

void VmtraceWriter::write_bytes(const unsigned char* data, std::size_t n) {
  if (n == 0) return;
  errno = 0;
  if (std::fwrite(data, 1, n, file_.get()) != n) throw Error(io_error("cannot write", path_));
}

void VmtraceWriter::append(std::uint8_t op, std::uint64_t stream, std::uint64_t addr,
                           std::uint64_t size) {
  if (!file_) throw Error("trace file '" + path_ + "' is closed");
  unsigned char record[kRecordBytes] = {};  // padding bytes 1..7 stay zero
  record[0] = op;
  put_le(record + 8, stream, 8);
  put_le(record + 16, addr, 8);
  put_le(record + 24, size, 8);
  buffer_.insert(buffer_.end(), record, record + kRecordBytes);
  ++events_;
  if (buffer_.size() >= kBufferRecords * kRecordBytes) {
    std::vector<unsigned char> full;
    full.swap(buffer_);  // dropped even if the write fails: a failed block is not retried
    buffer_.reserve(kBufferRecords * kRecordBytes);
    write_bytes(full.data(), full.size());
  }
}

void VmtraceWriter::flush() {
  if (!file_) return;
  std::vector<unsigned char> pending;
  pending.swap(buffer_);
  write_bytes(pending.data(), pending.size());
  errno = 0;
  if (std::fflush(file_.get()) != 0) throw Error(io_error("cannot flush", path_));
}

void VmtraceWriter::close() {
  if (!file_) return;
  try {
    flush();
    unsigned char count[8];
    put_le(count, events_, 8);
    errno = 0;
    if (std::fseek(file_.get(), kCountOffset, SEEK_SET) == 0) {
      write_bytes(count, sizeof count);
    }  // else not seekable (a pipe): the count stays "unknown", which readers accept
  } catch (...) {
    file_.reset();
    throw;
  }
  errno = 0;
  const int rc = std::fclose(file_.release());
  if (rc != 0) throw Error(io_error("cannot close", path_));
}

}  // namespace vmalloc
