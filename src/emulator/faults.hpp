// Fault injection: make the N-th call of an entry point fail with a chosen CUresult, so tests
// can drive every error path of code that uses the driver.
//
// Spec syntax (VMALLOC_EMULATOR_FAIL and vmallocEmulatorSetFaults), comma-separated:
//   entry:nth:code[:count]
// entry  an exported symbol or its cuda.h name (cuMemMap, cuStreamDestroy, ...)
// nth    1 = the next call of that entry point after the fault is armed
// code   a CUresult number (2) or name (CUDA_ERROR_OUT_OF_MEMORY)
// count  how many calls in a row fail from the nth on (default 1; 0 or * = all of them)
// Example: "cuMemMap:3:2" fails the third cuMemMap with CUDA_ERROR_OUT_OF_MEMORY.
// An injected failure changes nothing: the call returns the code before doing anything.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "entry_point_table.hpp"
#include "vmalloc/device/detail/cuda_driver.hpp"

namespace vmalloc::emulator {

class FaultPlan {
 public:
  // Arms a fault on calls nth .. nth+count-1 counted from `calls_so_far` (count 0: no end).
  void arm(EntryPoint entry, std::uint64_t nth, driver::CUresult code, std::uint64_t count,
           std::uint64_t calls_so_far);
  // Parses and arms a spec; on a syntax error arms nothing and returns the reason.
  std::string arm_spec(const std::string& spec, const CallCounts& counts);
  void clear() noexcept;
  // The code call number `call` of `entry` must fail with, or CUDA_SUCCESS.
  driver::CUresult check(EntryPoint entry, std::uint64_t call) noexcept;
  bool empty() const noexcept { return !armed_.load(std::memory_order_acquire); }

 private:
  struct Fault {
    EntryPoint entry;
    std::uint64_t first_call;  // absolute call numbers, inclusive
    std::uint64_t last_call;
    driver::CUresult code;
  };
  mutable std::mutex mutex_;
  std::vector<Fault> faults_;
  std::atomic<bool> armed_{false};
};

// A CUresult from "2" or "CUDA_ERROR_OUT_OF_MEMORY"; false when neither.
bool parse_cu_result(const std::string& text, driver::CUresult* code) noexcept;

}  // namespace vmalloc::emulator
