// LoggingAllocator: wraps any Allocator, forwards every call, and records each allocation and
// free to a .vmtrace file (RMM's logging_resource_adaptor is the model), so any job that
// allocates through vmalloc — directly, or as PyTorch's or CuPy's allocator through the C
// ABI — leaves a trace that `vmalloc replay` replays against other allocators.
//
// The trace is written consistent (see VmtraceWriter): the logging allocator remembers each live
// allocation's size, records a FREE with that size, and leaves out frees of pointers that were
// allocated before it was wrapped around the allocator (counted in unrecorded_frees()).
//
// Thread-safe. One mutex is held across the forwarded allocate/deallocate and its record, so
// the trace's order is an order in which the calls really happened (a pointer is never
// recorded as allocated again before its free).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/trace/vmtrace_writer.hpp"

namespace vmalloc {

class LoggingAllocator final : public Allocator {
 public:
  // Creates (truncates) the trace file at `path`. Throws InvalidArgument for a null upstream
  // or a path that cannot be created.
  LoggingAllocator(std::shared_ptr<Allocator> upstream, const std::string& path);
  // Closes the trace (a write failure at this point is lost: call close() to see it).
  ~LoggingAllocator() override;

  // Forwards; records ALLOC when memory was returned. After close() throws Error: a closed
  // log cannot record the allocation.
  device_ptr allocate(std::size_t nbytes, stream_t stream) override;
  // Forwards; records FREE when the upstream accepted it. After close() still forwards (so
  // memory can always be given back) but records nothing.
  void deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) override;
  std::size_t release_cached() override;
  Stats stats() const override;
  void reset_peak_stats() override;
  std::size_t allocation_size(device_ptr ptr) const override;
  std::vector<std::pair<device_ptr, std::size_t>> live_allocations() const override;
  // "logging:" + the upstream's name.
  std::string name() const override;
  const std::shared_ptr<Device>& device() const override;

  // Writes buffered records to the file. Throws Error if a write failed (now or earlier).
  void flush();
  // Finishes the trace file (buffered records, event count). Idempotent; throws Error if a
  // write failed. Later allocations throw; later frees are forwarded unrecorded.
  void close();

  bool closed() const;
  std::uint64_t events_written() const;
  // Frees of pointers the logging allocator never saw allocated (made before it was installed).
  std::uint64_t unrecorded_frees() const;
  // Allocations that failed upstream (out of memory ...): not in the trace.
  std::uint64_t failed_allocations() const;
  const std::string& path() const noexcept { return path_; }
  const std::shared_ptr<Allocator>& upstream() const noexcept { return upstream_; }

 private:
  void record(std::uint8_t op, stream_t stream, device_ptr ptr, std::size_t size);
  void throw_if_failed() const;

  const std::shared_ptr<Allocator> upstream_;
  const std::string path_;
  mutable std::mutex mutex_;
  VmtraceWriter writer_;
  std::unordered_map<device_ptr, std::size_t> live_;  // recorded allocations -> size
  std::string write_error_;  // the first write failure; recording stops after one
  bool closed_ = false;
  std::uint64_t unrecorded_frees_ = 0;
  std::uint64_t failed_allocations_ = 0;
};

}  // namespace vmalloc
