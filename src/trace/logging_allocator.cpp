#include "vmalloc/trace/logging_allocator.hpp"

#include <cstdio>
#include <utility>

#include "vmalloc/base/errors.hpp"

namespace vmalloc {
namespace {

// A JSON string literal of `text` (names of allocators and devices are plain, but escape
// anyway so the header's metadata always parses).
std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

const std::shared_ptr<Allocator>& checked(const std::shared_ptr<Allocator>& upstream) {
  if (!upstream) throw InvalidArgument("LoggingAllocator: the upstream allocator is null");
  return upstream;
}

std::string metadata_of(const Allocator& upstream) {
  std::string device = upstream.device() ? upstream.device()->name() : std::string("unknown");
  return "{\"created_by\": \"vmalloc::LoggingAllocator\", \"allocator\": " +
         json_string(upstream.name()) + ", \"device\": " + json_string(device) + "}";
}

}  // namespace

LoggingAllocator::LoggingAllocator(std::shared_ptr<Allocator> upstream, const std::string& path)
    : upstream_(checked(upstream)),
      path_(path),
      writer_(path, /*consistent=*/true, metadata_of(*upstream)) {}

LoggingAllocator::~LoggingAllocator() {
  try {
    close();
  } catch (...) {
    // Destructors do not throw; the failure was reported to whoever called flush()/close().
  }
}

void LoggingAllocator::record(std::uint8_t op, stream_t stream, device_ptr ptr, std::size_t size) {
  if (!write_error_.empty()) return;  // a trace with a hole would replay wrongly: stop
  try {
    writer_.append(op, stream, ptr, size);
  } catch (...) {
    // The allocation itself succeeded; failing it because the log disk is full would be
    // worse than losing the log. The error is reported by flush() and close(). Never
    // throws: a short message fits the string's inline buffer, without allocating.
    try {
      try {
        throw;
      } catch (const std::exception& e) {
        write_error_ = e.what();
      } catch (...) {
        write_error_ = "write failed";
      }
    } catch (...) {
      write_error_ = "out of memory";
    }
  }
}

void LoggingAllocator::throw_if_failed() const {
  if (!write_error_.empty()) {
    throw Error("LoggingAllocator stopped recording " + path_ + ": " + write_error_);
  }
}

device_ptr LoggingAllocator::allocate(std::size_t nbytes, stream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) {
    throw Error("LoggingAllocator: the trace " + path_ + " is closed; allocate through the "
                "upstream allocator instead");
  }
  device_ptr ptr = 0;
  try {
    ptr = upstream_->allocate(nbytes, stream);
  } catch (...) {
    ++failed_allocations_;
    throw;
  }
  if (ptr != 0) {
    try {
      live_[ptr] = nbytes;
    } catch (...) {
      // Out of host memory after the upstream allocation succeeded: give it back rather
      // than leak it, then report the failure. (record() never throws.)
      try {
        upstream_->deallocate(ptr, nbytes, stream);
      } catch (...) {
      }
      ++failed_allocations_;
      throw;
    }
    record(VmtraceWriter::op_alloc, stream, ptr, nbytes);
  }
  return ptr;
}

void LoggingAllocator::deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  upstream_->deallocate(ptr, nbytes, stream);  // throws with nothing changed, nothing recorded
  if (ptr == 0 || closed_) return;
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    ++unrecorded_frees_;
    return;
  }
  const std::size_t size = it->second;
  live_.erase(it);
  record(VmtraceWriter::op_free, stream, ptr, size);
}

std::size_t LoggingAllocator::release_cached() { return upstream_->release_cached(); }

Stats LoggingAllocator::stats() const { return upstream_->stats(); }

void LoggingAllocator::reset_peak_stats() { upstream_->reset_peak_stats(); }

std::vector<std::pair<device_ptr, std::size_t>> LoggingAllocator::live_allocations() const {
  return upstream_->live_allocations();
}

std::size_t LoggingAllocator::allocation_size(device_ptr ptr) const {
  return upstream_->allocation_size(ptr);
}

std::string LoggingAllocator::name() const { return "logging:" + upstream_->name(); }

const std::shared_ptr<Device>& LoggingAllocator::device() const { return upstream_->device(); }

void LoggingAllocator::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  throw_if_failed();
  try {
    writer_.flush();
  } catch (const std::exception& e) {
    write_error_ = e.what();
    throw_if_failed();
  }
}

void LoggingAllocator::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  live_.clear();
  try {
    writer_.close();
  } catch (const std::exception& e) {
    if (write_error_.empty()) write_error_ = e.what();
  }
  throw_if_failed();
}

bool LoggingAllocator::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

std::uint64_t LoggingAllocator::events_written() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return writer_.events();
}

std::uint64_t LoggingAllocator::unrecorded_frees() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return unrecorded_frees_;
}

std::uint64_t LoggingAllocator::failed_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_allocations_;
}

}  // namespace vmalloc
