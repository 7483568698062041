#include "emulator.hpp"

#include <algorithm>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "vmalloc/base/errors.hpp"

namespace vmalloc::emulator {

namespace {

thread_local std::string last_error_message;

// Sizes in the environment: "17179869184", "16GiB", "2MiB", "40MB" (as vmalloc.parse_size).
bool parse_size(const char* text, std::size_t* out) {
  std::string s(text);
  std::size_t digits = 0;
  while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
  if (digits == 0 || digits > 19) return false;
  unsigned long long value = std::strtoull(s.substr(0, digits).c_str(), nullptr, 10);
  std::string unit;
  for (std::size_t i = digits; i < s.size(); ++i)
    if (s[i] != ' ') unit += static_cast<char>(s[i] | 0x20);  // lower case
  struct Unit {
    const char* name;
    unsigned long long factor;
  };
  static const Unit units[] = {
      {"", 1}, {"b", 1},
      {"k", 1000ull}, {"kb", 1000ull}, {"m", 1000000ull}, {"mb", 1000000ull},
      {"g", 1000000000ull}, {"gb", 1000000000ull}, {"t", 1000000000000ull},
      {"tb", 1000000000000ull},
      {"kib", 1ull << 10}, {"mib", 1ull << 20}, {"gib", 1ull << 30}, {"tib", 1ull << 40},
  };
  for (const Unit& u : units) {
    if (unit == u.name) {
      if (value > (~0ull) / u.factor) return false;
      *out = static_cast<std::size_t>(value * u.factor);
      return true;
    }
  }
  return false;
}

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// Handle values: opaque, non-null, distinct per kind for the life of the process (also across
// resets, so a stale handle is never mistaken for a new one).
constexpr std::uintptr_t context_base = 0xC0000000000;
constexpr std::uintptr_t stream_base = 0x50000000000;
constexpr std::uintptr_t event_base = 0xE0000000000;

void exit_report() { Emulator::instance().write_exit_report(); }

}  // namespace

void fail(CUresult code, std::string message) { throw Failure{code, std::move(message)}; }

Config Config::from_environment() {
  Config c;
  if (const char* v = env("VMALLOC_EMULATOR_DEVICES")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || n < 0 || n > 64)
      c.error = std::string("VMALLOC_EMULATOR_DEVICES='") + v + "' is not a device count 0..64";
    else
      c.devices = static_cast<int>(n);
  }
  if (const char* v = env("VMALLOC_EMULATOR_CAPACITY")) {
    if (!parse_size(v, &c.capacity) || c.capacity == 0)
      c.error = std::string("VMALLOC_EMULATOR_CAPACITY='") + v +
                "' is not a size in bytes such as 17179869184 or 16GiB";
  }
  if (const char* v = env("VMALLOC_EMULATOR_GRANULARITY")) {
    if (!parse_size(v, &c.granularity) || c.granularity == 0)
      c.error = std::string("VMALLOC_EMULATOR_GRANULARITY='") + v +
                "' is not a size in bytes such as 2MiB";
  }
  if (const char* v = env("VMALLOC_EMULATOR_VERBOSE")) c.verbose = std::strcmp(v, "0") != 0;
  if (const char* v = env("VMALLOC_EMULATOR_LEAK_REPORT")) c.leak_report_path = v;
  if (const char* v = env("VMALLOC_EMULATOR_FAIL")) c.faults = v;
  return c;
}

Emulator& Emulator::instance() {
  // Never destroyed: entry points may be called from other libraries' static destructors.
  static Emulator* emulator = [] {
    auto* e = new Emulator();
    std::atexit(exit_report);
    return e;
  }();
  return *emulator;
}

Emulator::Emulator() {
  config_ = Config::from_environment();
  verbose_ = config_.verbose;
  if (config_.error.empty()) {
    make_gpus();
    const std::string why = faults_.arm_spec(config_.faults, counts_);
    if (!why.empty()) config_.error = "VMALLOC_EMULATOR_FAIL: " + why;
  }
  if (!config_.error.empty())
    std::fprintf(stderr, "vmalloc driver emulator: %s; cuInit will fail\n",
                 config_.error.c_str());
}

void Emulator::make_gpus() {
  try {
    for (int i = 0; i < config_.devices; ++i)
      gpus_.push_back(make_gpu(i, config_.capacity, config_.granularity));
  } catch (const std::exception& x) {
    // A granularity the emulated device refuses: no devices, and cuInit says why.
    gpus_.clear();
    config_.error = std::string("VMALLOC_EMULATOR_GRANULARITY / _CAPACITY: ") + x.what();
  }
}

std::unique_ptr<Gpu> Emulator::make_gpu(int ordinal, std::size_t capacity,
                                        std::size_t granularity) {
  HostDeviceOptions options;
  options.capacity = capacity;
  options.granularity = granularity;
  options.backed = true;
  options.ordinal = ordinal;
  auto gpu = std::make_unique<Gpu>();
  gpu->ordinal = ordinal;
  gpu->capacity = capacity;
  gpu->granularity = granularity;
  gpu->device = std::make_shared<HostDevice>(options);  // InvalidArgument for a bad granularity
  gpu->context = reinterpret_cast<CUcontext>(context_base + 0x10 * next_context_++);
  return gpu;
}

// ---- counting and errors ----

std::uint64_t Emulator::count(EntryPoint entry) noexcept { return counts_.increment(entry); }

std::uint64_t Emulator::call_count(EntryPoint entry) const noexcept { return counts_.get(entry); }

void Emulator::record_error(const char* name, CUresult code, const std::string& message) noexcept {
  try {
    last_error_message = std::string(name) + ": " +
                         cu_result_name(code) + ": " + message;
    if (verbose_) std::fprintf(stderr, "vmalloc driver emulator: %s\n", last_error_message.c_str());
  } catch (...) {
  }
}

std::string Emulator::last_error() { return last_error_message; }

// ---- initialization and devices ----

void Emulator::init(unsigned int flags) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (flags != 0) fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0, got " + std::to_string(flags));
  if (!config_.error.empty()) fail(CUDA_ERROR_INVALID_VALUE, config_.error);
  if (gpus_.empty())
    fail(CUDA_ERROR_NO_DEVICE, "the emulator has no devices (VMALLOC_EMULATOR_DEVICES=0)");
  initialized_ = true;
}

void Emulator::require_initialized() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!initialized_)
    fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit(0) has not been called (or the emulator was reset)");
}

int Emulator::device_count() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return static_cast<int>(gpus_.size());
}

Gpu& Emulator::gpu(CUdevice device) {
  if (device < 0 || device >= static_cast<int>(gpus_.size()))
    fail(CUDA_ERROR_INVALID_DEVICE, "device " + std::to_string(device) + " does not exist (" +
                                        std::to_string(gpus_.size()) + " emulated device" +
                                        (gpus_.size() == 1 ? "" : "s") + ")");
  return *gpus_[static_cast<std::size_t>(device)];
}

std::uintptr_t Emulator::next_stream_handle() { return stream_base + 0x10 * next_stream_++; }
std::uintptr_t Emulator::next_event_handle() { return event_base + 0x10 * next_event_++; }

// ---- routing ----

std::map<CUdeviceptr, Emulator::Reservation>::iterator Emulator::reservation_containing(
    CUdeviceptr ptr, const char* what) {
  auto it = reservations_.upper_bound(ptr);
  if (it != reservations_.begin()) {
    --it;
    if (ptr >= it->first && ptr - it->first < it->second.size) return it;
  }
  fail(CUDA_ERROR_INVALID_VALUE, std::string(what) + " " + hex(ptr) +
                                     " is not inside any reservation made with "
                                     "cuMemAddressReserve");
}

void Emulator::note_destroyed_stream(std::uintptr_t handle, int ordinal) {
  destroyed_streams_.emplace(handle, ordinal);
}

void Emulator::check_not_destroyed_stream(std::uintptr_t handle, const char* what) {
  auto it = destroyed_streams_.find(handle);
  if (it == destroyed_streams_.end()) return;
  const std::string message = "stream " + hex(handle) + " was destroyed (cuStreamDestroy) and " +
                              "then used by " + what +
                              ": using a destroyed stream handle is undefined on a GPU";
  try {
    misuses_.emplace_back(it->second, message);
  } catch (...) {
  }
  fail(CUDA_ERROR_INVALID_HANDLE, message);
}

std::pair<Gpu*, stream_t> Emulator::resolve_stream(CUstream stream) {
  const auto value = reinterpret_cast<std::uintptr_t>(stream);
  if (value == 0 || value == CU_STREAM_LEGACY) return {&current_gpu(), 0};
  if (value == CU_STREAM_PER_THREAD) {
    Gpu& gpu = current_gpu();
    static std::atomic<std::uint64_t> next_thread{1};
    thread_local const std::uint64_t id = next_thread.fetch_add(1);
    auto it = gpu.per_thread_streams.find(id);
    if (it == gpu.per_thread_streams.end()) {
      const stream_t host = gpu.device->create_stream(/*non_blocking=*/false);
      try {
        it = gpu.per_thread_streams.emplace(id, host).first;
      } catch (...) {
        gpu.device->destroy_stream(host);
        throw;
      }
    }
    return {&gpu, it->second};
  }
  auto it = streams_.find(value);
  check_not_destroyed_stream(value, "a driver call");
  if (it == streams_.end())
    fail(CUDA_ERROR_INVALID_HANDLE,
         "stream " + hex(value) + " is not a live stream (never created, or destroyed)");
  return {&gpu(it->second.ordinal), it->second.host};
}

Emulator::Event& Emulator::resolve_event(CUevent event) {
  const auto value = reinterpret_cast<std::uintptr_t>(event);
  auto it = events_.find(value);
  if (it == events_.end())
    fail(CUDA_ERROR_INVALID_HANDLE,
         "event " + hex(value) + " is not a live event (never created, or destroyed)");
  return it->second;
}

// ---- control ----

void Emulator::reset() {
  std::vector<std::unique_ptr<Gpu>> old;
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    old.swap(gpus_);
    allocations_.clear();
    reservations_.clear();
    mappings_.clear();
    host_blocks_.clear();
    streams_.clear();
    events_.clear();
    destroyed_streams_.clear();
    misuses_.clear();
    initialized_ = false;
    faults_.clear();
    counts_.reset();
    config_ = Config::from_environment();
    config_.faults.clear();  // a reset disarms faults; it does not rearm the environment's
    verbose_ = config_.verbose;
    if (config_.error.empty()) make_gpus();
  }
  // The old devices (and their memory) go outside the lock: destroying one drains its streams.
  old.clear();
}

int Emulator::add_device(std::size_t capacity, std::size_t granularity) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (gpus_.size() >= 64) fail(CUDA_ERROR_NOT_PERMITTED, "the emulator holds at most 64 devices");
  const int ordinal = static_cast<int>(gpus_.size());
  gpus_.push_back(make_gpu(ordinal, capacity ? capacity : config_.capacity,
                           granularity ? granularity : config_.granularity));
  return ordinal;
}

bool Emulator::in_use_locked(int ordinal) {
  const GpuState s = state(ordinal);
  return s.primary_context_refs || s.handles || s.released_still_mapped || s.reservations ||
         s.mappings || s.host_allocations || s.streams || s.events;
}

void Emulator::configure_device(int ordinal, std::size_t capacity, std::size_t granularity) {
  std::unique_ptr<Gpu> old;
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    gpu(ordinal);  // validates the ordinal
    if (in_use_locked(ordinal))
      fail(CUDA_ERROR_NOT_PERMITTED,
           "device " + std::to_string(ordinal) +
               " is in use (its primary context is retained or it holds resources); "
               "reconfigure only an idle device");
    auto fresh = make_gpu(ordinal, capacity ? capacity : config_.capacity,
                          granularity ? granularity : config_.granularity);
    old = std::move(gpus_[static_cast<std::size_t>(ordinal)]);
    gpus_[static_cast<std::size_t>(ordinal)] = std::move(fresh);
    // A fresh device: the misuses reported for the old one go with it.
    misuses_.erase(std::remove_if(misuses_.begin(), misuses_.end(),
                                  [&](const auto& m) { return m.first == ordinal; }),
                   misuses_.end());
  }
}

GpuState Emulator::state(int ordinal) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  const Gpu& g = gpu(ordinal);
  GpuState s;
  s.capacity = g.capacity;
  s.granularity = g.granularity;
  s.primary_context_refs = static_cast<std::size_t>(g.primary_refs);
  for (const auto& [handle, a] : allocations_) {
    if (a.ordinal != ordinal) continue;
    if (a.released)
      ++s.released_still_mapped;
    else
      ++s.handles;
    s.bytes_created += a.size;
  }
  for (const auto& [ptr, r] : reservations_) {
    if (r.ordinal != ordinal) continue;
    ++s.reservations;
    s.bytes_reserved += r.size;
  }
  for (const auto& [ptr, m] : mappings_) {
    auto a = allocations_.find(m.handle);
    if (a == allocations_.end() || a->second.ordinal != ordinal) continue;
    ++s.mappings;
    s.bytes_mapped += m.size;
  }
  for (const auto& [ptr, h] : host_blocks_) {
    if (h.ordinal != ordinal) continue;
    ++s.host_allocations;
    s.host_bytes += h.size;
  }
  for (const auto& [handle, st] : streams_) s.streams += st.ordinal == ordinal;
  for (const auto& [handle, ev] : events_) s.events += ev.ordinal == ordinal;
  return s;
}

}  // namespace vmalloc::emulator
