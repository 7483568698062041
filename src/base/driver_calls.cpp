#include "vmalloc/base/driver_calls.hpp"

namespace vmalloc {

namespace {
struct CallInfo {
  const char* name;
  const char* entry_point;
};
constexpr CallInfo call_info[driver_call_count] = {
    {"create", "cuMemCreate"},
    {"release", "cuMemRelease"},
    {"reserve", "cuMemAddressReserve"},
    {"free_address", "cuMemAddressFree"},
    {"map", "cuMemMap"},
    {"unmap", "cuMemUnmap"},
    {"set_access", "cuMemSetAccess"},
    {"host_alloc", "cuMemHostAlloc"},
    {"host_free", "cuMemFreeHost"},
    {"stream_create", "cuStreamCreate"},
    {"stream_destroy", "cuStreamDestroy"},
    {"event_create", "cuEventCreate"},
    {"event_destroy", "cuEventDestroy"},
    {"event_record", "cuEventRecord"},
    {"event_query", "cuEventQuery"},
    {"event_synchronize", "cuEventSynchronize"},
    {"stream_wait_event", "cuStreamWaitEvent"},
    {"stream_synchronize", "cuStreamSynchronize"},
    {"synchronize", "cuCtxSynchronize"},
    {"copy_to_device", "cuMemcpyHtoDAsync"},
    {"copy_to_host", "cuMemcpyDtoHAsync"},
    {"copy_device", "cuMemcpyDtoDAsync"},
};
}  // namespace

const char* driver_call_name(DriverCall call) noexcept {
  auto i = static_cast<std::size_t>(call);
  return i < driver_call_count ? call_info[i].name : "?";
}

const char* driver_call_entry_point(DriverCall call) noexcept {
  auto i = static_cast<std::size_t>(call);
  return i < driver_call_count ? call_info[i].entry_point : "?";
}

CostModel CostModel::defaults() noexcept {
  CostModel m;
  auto set = [&m](DriverCall c, double seconds) {
    m.seconds_per_call[static_cast<std::size_t>(c)] = seconds;
  };
  set(DriverCall::create, 193e-6);
  set(DriverCall::map, 1.45e-6);
  set(DriverCall::set_access, 36e-6);
  set(DriverCall::unmap, 25.6e-6);
  set(DriverCall::reserve, 19e-6);
  set(DriverCall::release, 25.6e-6);       // not measured: modeled like cuMemUnmap
  set(DriverCall::free_address, 19e-6);    // not measured: modeled like cuMemAddressReserve
  m.to_device_bytes_per_second = 55.3e9;
  m.to_host_bytes_per_second = 55.1e9;
  m.device_bytes_per_second = 3.35e12 / 2;
  return m;
}

std::uint64_t CounterSnapshot::memory_management_calls() const noexcept {
  std::uint64_t n = 0;
  for (DriverCall c : {DriverCall::create, DriverCall::release, DriverCall::reserve,
                       DriverCall::free_address, DriverCall::map, DriverCall::unmap,
                       DriverCall::set_access})
    n += (*this)[c];
  return n;
}

DriverCounters::DriverCounters() : model_(CostModel::defaults()) {
  for (auto& c : calls_) c.store(0, std::memory_order_relaxed);
}

void DriverCounters::count_copy(DriverCall call, std::size_t bytes) noexcept {
  count(call);
  switch (call) {
    case DriverCall::copy_to_device:
      bytes_to_device_.fetch_add(bytes, std::memory_order_relaxed);
      break;
    case DriverCall::copy_to_host:
      bytes_to_host_.fetch_add(bytes, std::memory_order_relaxed);
      break;
    default:
      bytes_device_.fetch_add(bytes, std::memory_order_relaxed);
      break;
  }
}

CounterSnapshot DriverCounters::snapshot() const {
  CounterSnapshot s;
  for (std::size_t i = 0; i < driver_call_count; ++i)
    s.calls[i] = calls_[i].load(std::memory_order_relaxed);
  s.bytes_to_device = bytes_to_device_.load(std::memory_order_relaxed);
  s.bytes_to_host = bytes_to_host_.load(std::memory_order_relaxed);
  s.bytes_device = bytes_device_.load(std::memory_order_relaxed);
  const CostModel m = cost_model();
  for (std::size_t i = 0; i < driver_call_count; ++i)
    s.modeled_seconds += static_cast<double>(s.calls[i]) * m.seconds_per_call[i];
  auto copy_time = [](std::uint64_t bytes, double bandwidth) {
    return bandwidth > 0 ? static_cast<double>(bytes) / bandwidth : 0.0;
  };
  s.modeled_copy_seconds = copy_time(s.bytes_to_device, m.to_device_bytes_per_second) +
                           copy_time(s.bytes_to_host, m.to_host_bytes_per_second) +
                           copy_time(s.bytes_device, m.device_bytes_per_second);
  return s;
}

void DriverCounters::reset() noexcept {
  for (auto& c : calls_) c.store(0, std::memory_order_relaxed);
  bytes_to_device_ = 0;
  bytes_to_host_ = 0;
  bytes_device_ = 0;
}

CostModel DriverCounters::cost_model() const {
  std::lock_guard<std::mutex> lock(model_mutex_);
  return model_;
}

void DriverCounters::set_cost_model(const CostModel& model) {
  std::lock_guard<std::mutex> lock(model_mutex_);
  model_ = model;
}

}  // namespace vmalloc
