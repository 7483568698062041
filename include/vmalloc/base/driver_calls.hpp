// Counting driver-equivalent calls and modeling what they would cost on a real GPU.
//
// Every Device counts each call it makes (or, for HostDevice, each call it emulates), so the
// allocators can be compared by driver traffic, and a modeled time tells what that traffic
// would cost on a GPU this project cannot run on.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace vmalloc {

// One entry per driver-equivalent call. The names (driver_call_name) are the keys of
// Device.counters() in Python.
enum class DriverCall : int {
  create = 0,         // cuMemCreate
  release,            // cuMemRelease
  reserve,            // cuMemAddressReserve
  free_address,       // cuMemAddressFree
  map,                // cuMemMap
  unmap,              // cuMemUnmap
  set_access,         // cuMemSetAccess
  host_alloc,         // cuMemHostAlloc
  host_free,          // cuMemFreeHost
  stream_create,      // cuStreamCreate
  stream_destroy,     // cuStreamDestroy
  event_create,       // cuEventCreate
  event_destroy,      // cuEventDestroy
  event_record,       // cuEventRecord
  event_query,        // cuEventQuery
  event_synchronize,  // cuEventSynchronize
  stream_wait_event,  // cuStreamWaitEvent
  stream_synchronize, // cuStreamSynchronize
  synchronize,        // cuCtxSynchronize
  copy_to_device,     // cuMemcpyHtoDAsync
  copy_to_host,       // cuMemcpyDtoHAsync
  copy_device,        // cuMemcpyDtoDAsync
  count_              // number of entries, not a call
};

inline constexpr std::size_t driver_call_count = static_cast<std::size_t>(DriverCall::count_);

// "create", "release", "reserve", "free_address", "map", "unmap", "set_access", ...
const char* driver_call_name(DriverCall call) noexcept;
inline const char* driver_call_name_at(std::size_t index) noexcept {
  return driver_call_name(static_cast<DriverCall>(index));
}
// The driver entry point the call stands for: "cuMemCreate", ...
const char* driver_call_entry_point(DriverCall call) noexcept;

// Seconds per call and copy bandwidths of a modeled GPU. Defaults are published figures,
// see CostModel::defaults() and docs/concepts.rst.
struct CostModel {
  std::array<double, driver_call_count> seconds_per_call{};
  double to_device_bytes_per_second = 0;  // 0 = copies are not modeled
  double to_host_bytes_per_second = 0;
  double device_bytes_per_second = 0;

  // A100 VMM call costs from ../shared/reference/numbers.md (kvcached bench_vmm, mean):
  // cuMemCreate 193 us, cuMemMap 1.45 us, cuMemSetAccess 36 us, cuMemUnmap 25.6 us,
  // cuMemAddressReserve 19 us. cuMemRelease and cuMemAddressFree were not measured: they are
  // modeled as their inverse calls' neighbours (unmap 25.6 us, reserve 19 us). Copies: PCIe
  // Gen5 x16 pinned, nvbandwidth H800: HtoD 55.3 GB/s, DtoH 55.1 GB/s; DtoD HBM3 3.35 TB/s / 2
  // (a copy reads and writes). Other calls are modeled as free: no published figures.
  static CostModel defaults() noexcept;
  double seconds_at(std::size_t index) const noexcept { return seconds_per_call[index]; }
  void set_seconds_at(std::size_t index, double seconds) noexcept {
    seconds_per_call[index] = seconds;
  }
};

// A consistent copy of the counters at one moment.
struct CounterSnapshot {
  std::array<std::uint64_t, driver_call_count> calls{};
  std::uint64_t bytes_to_device = 0;
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_device = 0;
  double modeled_seconds = 0;       // sum over calls of count * seconds_per_call
  double modeled_copy_seconds = 0;  // bytes / bandwidth, per direction

  std::uint64_t operator[](DriverCall call) const noexcept {
    return calls[static_cast<std::size_t>(call)];
  }
  std::uint64_t call_count_at(std::size_t index) const noexcept { return calls[index]; }
  // Calls that change the memory map: create, release, reserve, free_address, map, unmap,
  // set_access. "No driver calls after warm-up" is measured on these.
  std::uint64_t memory_management_calls() const noexcept;
};

// Thread-safe counters. Counting is a relaxed atomic add: cheap enough for every call.
class DriverCounters {
 public:
  DriverCounters();
  void count(DriverCall call) noexcept {
    calls_[static_cast<std::size_t>(call)].fetch_add(1, std::memory_order_relaxed);
  }
  void count_copy(DriverCall call, std::size_t bytes) noexcept;
  CounterSnapshot snapshot() const;
  void reset() noexcept;
  CostModel cost_model() const;
  void set_cost_model(const CostModel& model);

 private:
  std::array<std::atomic<std::uint64_t>, driver_call_count> calls_;
  std::atomic<std::uint64_t> bytes_to_device_{0}, bytes_to_host_{0}, bytes_device_{0};
  mutable std::mutex model_mutex_;
  CostModel model_;
};

}  // namespace vmalloc
