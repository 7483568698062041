// HostDevice: copies (cuMemcpyHtoDAsync, cuMemcpyDtoHAsync, cuMemcpyDtoDAsync), checked at the
// call and again when they run, in order, on their stream.
#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/stream_set.hpp"
#include "vmalloc/device/host_device.hpp"

namespace vmalloc {

using detail::hex;

namespace {

// Copies run in pieces so that a huge copy never holds the bookkeeping lock for long.
constexpr std::size_t copy_piece = std::size_t{64} << 20;

}  // namespace

struct HostDevice::CopyJob {
  DriverCall call = DriverCall::copy_device;
  device_ptr dst = 0;                 // device destination (to_device, device)
  device_ptr src = 0;                 // device source (to_host, device)
  unsigned char* host_dst = nullptr;  // to_host
  const unsigned char* host_src = nullptr;  // to_device: the caller's pinned memory or staging
  std::shared_ptr<std::vector<unsigned char>> staging;  // a pageable source's bytes
  bool host_pinned = false;           // host side is host_alloc memory: re-checked at execution
  std::size_t nbytes = 0;
};

void HostDevice::execute_copy(const CopyJob& job) {
  const char* entry = driver_call_entry_point(job.call);
  const bool reads_device = job.call != DriverCall::copy_to_device;
  const bool writes_device = job.call != DriverCall::copy_to_host;
  // Device-to-device copies between overlapping ranges go backwards when the destination
  // is above the source, like memmove.
  const bool backwards = job.call == DriverCall::copy_device && job.dst > job.src &&
                         job.dst < job.src + job.nbytes;
  const std::size_t piece = backed_ ? copy_piece : job.nbytes;
  for (std::size_t done = 0; done < job.nbytes; done += piece) {
    const std::size_t n = std::min(piece, job.nbytes - done);
    const std::size_t off = backwards ? job.nbytes - done - n : done;
    // Shared: copies run alongside each other, never alongside a change of the map.
    std::shared_lock<std::shared_mutex> lock(mutex_);
    std::string why;
    if (reads_device) why = check_accessible(job.src + off, n);
    if (why.empty() && writes_device) why = check_accessible(job.dst + off, n);
    if (!why.empty())
      throw DeviceError(std::string(entry) + " of " + std::to_string(job.nbytes) +
                            " bytes faulted: " + why,
                        entry, cu_result::illegal_address);
    if (job.host_pinned) {
      const auto host = reinterpret_cast<std::uintptr_t>(job.host_dst ? job.host_dst
                                                                        : job.host_src);
      if (!host_range_pinned(host + off, n))
        throw DeviceError(std::string(entry) + " faulted: its pinned host memory at " +
                              hex(host) + " was freed before the copy ran",
                          entry, cu_result::illegal_address);
    }
    if (!backed_) continue;  // accounting only: nothing to move
    if (checked_ && (checked_guarded(job.src + off, n) || checked_guarded(job.dst + off, n))) {
      // Stream-ordered: queued before the free, so it may still use the bytes.
      copy_through_memfd(job, off, n);
      continue;
    }
    switch (job.call) {
      case DriverCall::copy_to_device:
        std::memcpy(reinterpret_cast<void*>(job.dst + off), job.host_src + off, n);
        break;
      case DriverCall::copy_to_host:
        std::memcpy(job.host_dst + off, reinterpret_cast<const void*>(job.src + off), n);
        break;
      default:
        std::memmove(reinterpret_cast<void*>(job.dst + off),
                     reinterpret_cast<const void*>(job.src + off), n);
        break;
    }
  }
}

void HostDevice::copy_through_memfd(const CopyJob& job, std::size_t off, std::size_t n) const {
  switch (job.call) {
    case DriverCall::copy_to_device:
      memfd_io(job.dst + off, const_cast<unsigned char*>(job.host_src + off), n, true);
      break;
    case DriverCall::copy_to_host:
      memfd_io(job.src + off, job.host_dst + off, n, false);
      break;
    default: {
      std::vector<unsigned char> piece(n);
      memfd_io(job.src + off, piece.data(), n, false);
      memfd_io(job.dst + off, piece.data(), n, true);
      break;
    }
  }
}

void HostDevice::enqueue_copy(const CopyJob& job, stream_t stream, bool wait) {
  const char* entry = driver_call_entry_point(job.call);
  bool counted = false;
  struct CountFailure {  // a refused copy still counts as a call, without bytes
    HostDevice* self;
    DriverCall call;
    const bool& counted;
    ~CountFailure() {
      if (!counted) self->count(call);
    }
  } count_failure{this, job.call, counted};

  if ((job.call == DriverCall::copy_to_device && job.host_src == nullptr) ||
      (job.call == DriverCall::copy_to_host && job.host_dst == nullptr))
    fail(job.call, "the host pointer is null", cu_result::invalid_value);
  if (job.nbytes > max_request_bytes)
    fail(job.call,
         "size " + std::to_string(job.nbytes) + " is larger than vmalloc's limit of 2**56 bytes",
         cu_result::invalid_value);
  streams_->check_stream(stream, entry);
  CopyJob queued = job;
  if (job.nbytes > 0) {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    std::string why;
    if (job.call != DriverCall::copy_to_device) why = check_accessible(job.src, job.nbytes);
    if (why.empty() && job.call != DriverCall::copy_to_host)
      why = check_accessible(job.dst, job.nbytes);
    // A range not mapped, or mapped without access, when the copy is issued: refused at once
    // with CUDA_ERROR_INVALID_VALUE and nothing queued, as a real driver does (580.159 on an
    // H200, for an unmapped range, one without access and one running off its mapping's end:
    // scripts/gpucheck/rules.py). A range unmapped under a queued copy still faults when the
    // copy runs (CUDA_ERROR_ILLEGAL_ADDRESS, execute_copy).
    if (!why.empty()) fail(job.call, why, cu_result::invalid_value);
    if (checked_) {
      // Checked mode's use-after-free: mapped memory a real GPU would copy; reported as the
      // fault a kernel touching it would be.
      if (job.call != DriverCall::copy_to_device) why = checked_refusal(job.src, job.nbytes);
      if (why.empty() && job.call != DriverCall::copy_to_host)
        why = checked_refusal(job.dst, job.nbytes);
    }
    if (!why.empty()) fail(job.call, why, cu_result::illegal_address);
    if (job.call == DriverCall::copy_to_device)
      queued.host_pinned =
          host_range_pinned(reinterpret_cast<std::uintptr_t>(job.host_src), job.nbytes);
    else if (job.call == DriverCall::copy_to_host)
      queued.host_pinned =
          host_range_pinned(reinterpret_cast<std::uintptr_t>(job.host_dst), job.nbytes);
  }
  detail::StreamSet* streams = streams_.get();
  auto run = [this, streams](const CopyJob& copy) {
    try {
      execute_copy(copy);
    } catch (const std::exception& e) {
      streams->record_fault(e.what());
    }
  };
  // A pageable copy on a stream with nothing to wait for runs here, now, as the stream's next
  // item: the caller waits for a DtoH copy anyway, and an HtoD copy would copy every byte to
  // staging anyway. Handed to the stream's thread it cost two thread wakeups: a 16-byte read
  // took 66 us on an idle 2-core VM, 3 us on a busy one (docs/benchmarks.md).
  if (job.call != DriverCall::copy_device && !queued.host_pinned &&
      streams_->run_if_idle(stream, [&] { run(queued); }, entry)) {
    counted = true;
    count_copy(job.call, job.nbytes);
    return;
  }
  // As with the driver: from pageable memory an HtoD copy takes its bytes at the call (the
  // caller may reuse the buffer at once) and a DtoH copy returns only once done.
  if (backed_ && job.call == DriverCall::copy_to_device && !queued.host_pinned && job.nbytes) {
    queued.staging = std::make_shared<std::vector<unsigned char>>(job.host_src,
                                                                  job.host_src + job.nbytes);
    queued.host_src = queued.staging->data();
  }
  if (job.call == DriverCall::copy_to_host && !queued.host_pinned) wait = true;
  auto ticket = streams_->enqueue(stream, [run, queued] { run(queued); }, entry);
  counted = true;
  count_copy(job.call, job.nbytes);
  if (wait) ticket.wait();
}

void HostDevice::copy_to_device(device_ptr dst, const void* src, std::size_t nbytes,
                                stream_t stream) {
  CopyJob job;
  job.call = DriverCall::copy_to_device;
  job.dst = dst;
  job.host_src = static_cast<const unsigned char*>(src);
  job.nbytes = nbytes;
  enqueue_copy(job, stream, false);
}

void HostDevice::copy_to_host(void* dst, device_ptr src, std::size_t nbytes, stream_t stream) {
  CopyJob job;
  job.call = DriverCall::copy_to_host;
  job.src = src;
  job.host_dst = static_cast<unsigned char*>(dst);
  job.nbytes = nbytes;
  enqueue_copy(job, stream, false);
}

void HostDevice::copy_device(device_ptr dst, device_ptr src, std::size_t nbytes,
                             stream_t stream) {
  CopyJob job;
  job.call = DriverCall::copy_device;
  job.dst = dst;
  job.src = src;
  job.nbytes = nbytes;
  enqueue_copy(job, stream, false);
}

}  // namespace vmalloc
