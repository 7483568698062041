// The entry points the driver emulator exports, as an enum for counting calls and injecting
// faults. Generated from the same table CudaDevice resolves (detail/cuda_driver.hpp), so the
// emulator exports exactly what CudaDevice uses. The exported functions are in driver_api.cpp.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "vmalloc/device/detail/cuda_driver.hpp"

namespace vmalloc::emulator {

// Entry points the emulator exports beyond what CudaDevice resolves: the driver's symbol
// lookup, which cuda-bindings (cuda.bindings.driver) resolves every other function through.
#define VMALLOC_EMULATOR_EXTRA_ENTRY_POINTS(X)                                               \
  X(cuGetProcAddress, "cuGetProcAddress",                                                    \
    (const char* symbol, void** pfn, int cudaVersion, unsigned long long flags))             \
  X(cuGetProcAddress_v2, "cuGetProcAddress_v2",                                              \
    (const char* symbol, void** pfn, int cudaVersion, unsigned long long flags,              \
     int* symbolStatus))

#define VMALLOC_EMULATOR_ENTRY_POINTS(X) \
  VMALLOC_CUDA_ENTRY_POINTS(X)           \
  VMALLOC_EMULATOR_EXTRA_ENTRY_POINTS(X)

enum class EntryPoint : int {
#define VMALLOC_EMULATOR_ENUM(member, symbol, params) member,
  VMALLOC_EMULATOR_ENTRY_POINTS(VMALLOC_EMULATOR_ENUM)
#undef VMALLOC_EMULATOR_ENUM
  count_
};

inline constexpr std::size_t entry_point_count = static_cast<std::size_t>(EntryPoint::count_);

// The exported symbol: "cuMemMap", "cuMemcpyHtoDAsync_v2", ...
const char* entry_point_symbol(EntryPoint entry) noexcept;
// Finds an entry point by its exported symbol or by its cuda.h name ("cuStreamDestroy" finds
// cuStreamDestroy_v2). False when unknown.
bool find_entry_point(const std::string& name, EntryPoint* entry) noexcept;

// Calls per entry point since load or reset. Relaxed atomics: counting must be cheap.
class CallCounts {
 public:
  CallCounts() { reset(); }
  // Counts one call; returns its number (1 for the first call).
  std::uint64_t increment(EntryPoint entry) noexcept {
    return counts_[static_cast<std::size_t>(entry)].fetch_add(1, std::memory_order_relaxed) + 1;
  }
  std::uint64_t get(EntryPoint entry) const noexcept {
    return counts_[static_cast<std::size_t>(entry)].load(std::memory_order_relaxed);
  }
  void reset() noexcept {
    for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<std::uint64_t>, entry_point_count> counts_;
};

}  // namespace vmalloc::emulator
