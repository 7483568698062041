// The driver emulator's state: a strict stand-in for libcuda.so.1 built on HostDevice.
//
// One HostDevice per emulated GPU ordinal holds the memory and enforces the virtual memory
// rules (../shared/reference/cuda-vmm.md); this layer adds what the driver's C interface needs
// on top: cuInit, devices, primary contexts and the per-thread context stack, the driver's
// opaque handles (allocation handles, streams, events, contexts) and their routing to the right
// device, argument checks of the C structs and flags, per-entry-point call counts, fault
// injection, the last error message and the leak report. Internal to the emulator library.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "entry_point_table.hpp"
#include "contexts.hpp"
#include "faults.hpp"
#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/cuda_driver.hpp"
#include "vmalloc/device/host_device.hpp"

namespace vmalloc::emulator {

using namespace vmalloc::driver;

// Thrown inside an entry point to return `code` with a readable `message`.
struct Failure {
  CUresult code;
  std::string message;
};
[[noreturn]] void fail(CUresult code, std::string message);

// What the environment configures (read at load and at reset).
struct Config {
  int devices = 1;                                         // VMALLOC_EMULATOR_DEVICES
  std::size_t capacity = std::size_t{16} << 30;            // VMALLOC_EMULATOR_CAPACITY
  std::size_t granularity = std::size_t{2} << 20;          // VMALLOC_EMULATOR_GRANULARITY
  bool verbose = false;                                    // VMALLOC_EMULATOR_VERBOSE
  std::string leak_report_path;                            // VMALLOC_EMULATOR_LEAK_REPORT
  std::string faults;                                      // VMALLOC_EMULATOR_FAIL
  std::string error;  // why the environment is invalid (cuInit then fails with this)

  static Config from_environment();
};

// One emulated GPU.
struct Gpu {
  int ordinal = 0;
  std::size_t capacity = 0;
  std::size_t granularity = 0;
  std::shared_ptr<HostDevice> device;
  CUcontext context = nullptr;  // the primary context's handle
  int primary_refs = 0;         // cuDevicePrimaryCtxRetain minus Release
  // CU_STREAM_PER_THREAD: each host thread's own default stream, made on first use (a
  // blocking stream: ordered with the legacy default stream, as on a GPU). Not counted as a
  // created stream; it lives as long as the device.
  // Keyed by a number unique to each thread of the process (thread ids are reused).
  std::map<std::uint64_t, stream_t> per_thread_streams;
};

// Counts of what one emulated GPU holds (see VmallocEmulatorDeviceState in control.cpp).
struct GpuState {
  std::size_t capacity = 0, granularity = 0;
  std::size_t primary_context_refs = 0;
  std::size_t handles = 0, released_still_mapped = 0, bytes_created = 0;
  std::size_t reservations = 0, bytes_reserved = 0;
  std::size_t mappings = 0, bytes_mapped = 0;
  std::size_t host_allocations = 0, host_bytes = 0;
  std::size_t streams = 0, events = 0;
};

class Emulator {
 public:
  // The process-wide emulator, created on first use and never destroyed (calls may arrive
  // during process teardown).
  static Emulator& instance();

  // ---- bookkeeping of every entry point ----
  // Counts a call; returns its number (1 = the first call of `entry` since load or reset).
  std::uint64_t count(EntryPoint entry) noexcept;
  std::uint64_t call_count(EntryPoint entry) const noexcept;
  const CallCounts& counts() const noexcept { return counts_; }
  FaultPlan& faults() noexcept { return faults_; }

  // ---- initialization, devices, contexts ----
  void init(unsigned int flags);
  void require_initialized() const;
  int device_count() const;
  Gpu& gpu(CUdevice device);  // CUDA_ERROR_INVALID_DEVICE if out of range; caller locks
  void retain_primary(CUcontext* context, CUdevice device);
  void release_primary(CUdevice device);
  bool known_context(CUcontext context) const;
  // The emulated GPU of the calling thread's current context; CUDA_ERROR_INVALID_CONTEXT when
  // there is none, it is unknown, or its primary context is not retained.
  Gpu& current_gpu();

  // ---- the driver's handles; the caller holds mutex() ----
  struct Allocation {
    int ordinal;
    physical_handle host;  // the HostDevice handle
    std::size_t size;
    std::size_t mappings = 0;
    bool released = false;
  };
  struct Reservation {
    int ordinal;
    std::size_t size;
  };
  struct Mapping {
    std::size_t size;
    CUmemGenericAllocationHandle handle;
  };
  struct HostBlock {
    int ordinal;
    std::size_t size;
  };
  struct Stream {
    int ordinal;
    stream_t host;
    unsigned int flags;
  };
  struct Event {
    int ordinal;
    event_t host;
  };

  std::recursive_mutex& mutex() const noexcept { return mutex_; }
  std::map<CUmemGenericAllocationHandle, Allocation>& allocations() { return allocations_; }
  std::map<CUdeviceptr, Reservation>& reservations() { return reservations_; }
  std::map<CUdeviceptr, Mapping>& mappings() { return mappings_; }
  std::map<void*, HostBlock>& host_blocks() { return host_blocks_; }
  std::map<std::uintptr_t, Stream>& streams() { return streams_; }
  std::map<std::uintptr_t, Event>& events() { return events_; }
  // Notes a stream just destroyed (its handle is never reused): later uses are misuses.
  void note_destroyed_stream(std::uintptr_t handle, int ordinal);
  // Fails (CUDA_ERROR_INVALID_HANDLE) and records the misuse if `handle` is a destroyed
  // stream's; returns otherwise.
  void check_not_destroyed_stream(std::uintptr_t handle, const char* what);
  CUmemGenericAllocationHandle next_allocation_handle() { return next_allocation_handle_++; }
  std::uintptr_t next_stream_handle();
  std::uintptr_t next_event_handle();

  // The reservation containing [ptr, ptr+size) (size 0: just ptr); CUDA_ERROR_INVALID_VALUE
  // naming `what` when no reservation made through this driver contains it.
  std::map<CUdeviceptr, Reservation>::iterator reservation_containing(CUdeviceptr ptr,
                                                                      const char* what);
  // A stream handle (0 and CU_STREAM_LEGACY are the current context's default stream,
  // CU_STREAM_PER_THREAD the calling thread's per-thread default stream) as its GPU and
  // HostDevice stream; CUDA_ERROR_INVALID_HANDLE if unknown. A destroyed stream's handle
  // fails too, and the use is recorded in the leak report: on a GPU it is undefined.
  std::pair<Gpu*, stream_t> resolve_stream(CUstream stream);
  Event& resolve_event(CUevent event);

  // ---- control (vmallocEmulator*) ----
  // Drops every device, handle, context, fault and count; rereads the environment.
  void reset();
  int add_device(std::size_t capacity, std::size_t granularity);
  // Replaces device `ordinal` by a fresh one; CUDA_ERROR_NOT_PERMITTED while it is in use
  // (primary context retained or anything allocated). 0 = the configured default.
  void configure_device(int ordinal, std::size_t capacity, std::size_t granularity);
  GpuState state(int ordinal);
  // Every resource still alive, one line each ("" when nothing leaked); ordinal < 0: all.
  std::string leak_report(int ordinal);
  void write_exit_report() noexcept;

  // ---- errors ----
  // Records `message` as the calling thread's last error (and prints it when verbose).
  // `name` is the entry point's symbol or the control function's name.
  void record_error(const char* name, CUresult code, const std::string& message) noexcept;
  static std::string last_error();
  void set_verbose(bool verbose) noexcept { verbose_ = verbose; }

 private:
  Emulator();
  void make_gpus();  // config_.devices of them; on failure none, and config_.error says why
  std::unique_ptr<Gpu> make_gpu(int ordinal, std::size_t capacity, std::size_t granularity);
  bool in_use_locked(int ordinal);

  mutable std::recursive_mutex mutex_;
  Config config_;
  bool initialized_ = false;
  std::vector<std::unique_ptr<Gpu>> gpus_;
  std::uint64_t generation_ = 0;  // makes handles of different resets distinct
  std::uint64_t next_context_ = 1;
  std::uint64_t next_stream_ = 1;
  std::uint64_t next_event_ = 1;
  CUmemGenericAllocationHandle next_allocation_handle_ = 1;
  std::map<CUmemGenericAllocationHandle, Allocation> allocations_;
  std::map<CUdeviceptr, Reservation> reservations_;
  std::map<CUdeviceptr, Mapping> mappings_;
  std::map<void*, HostBlock> host_blocks_;
  std::map<std::uintptr_t, Stream> streams_;
  std::map<std::uintptr_t, Event> events_;
  std::map<std::uintptr_t, int> destroyed_streams_;     // handle -> ordinal
  std::vector<std::pair<int, std::string>> misuses_;    // ordinal, what was done

  CallCounts counts_;
  FaultPlan faults_;
  std::atomic<bool> verbose_{false};
};

// Addresses and handles ("0x7f...") and sizes ("2.00 MiB (2097152 bytes)") in messages: the
// library's own formatters, so that the emulator and vmalloc write sizes alike.
inline std::string hex(std::uintptr_t value) { return vmalloc::detail::hex(value); }
inline std::string bytes(std::size_t n) { return vmalloc::detail::human_bytes(n, true); }

}  // namespace vmalloc::emulator
