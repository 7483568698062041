// The exceptions vmalloc's C++ core throws. The Cython layer turns each into the Python
// exception of the same meaning (vmalloc/errors.py); the C ABI turns them into error codes.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace vmalloc {

// Base of every vmalloc error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A size, alignment, option or handle value that can never be valid (negative, absurd,
// not a multiple of the granularity, ...). Nothing was changed.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A pointer the allocator does not own: never allocated, already freed, or an interior
// pointer. Nothing was changed.
class InvalidPointer : public Error {
 public:
  using Error::Error;
};

// The device (or a budget) cannot supply the memory. `requested` is the request in bytes;
// `state` a one-line summary of the allocator or device at the time.
class OutOfMemory : public Error {
 public:
  OutOfMemory(const std::string& message, std::size_t requested, std::string state = {})
      : Error(message), requested_(requested), state_(std::move(state)) {}
  std::size_t requested() const noexcept { return requested_; }
  const std::string& state() const noexcept { return state_; }

 private:
  std::size_t requested_;
  std::string state_;
};

// A device call failed or broke a rule of the driver API. `call` names the driver-equivalent
// call ("cuMemMap"), `code` is the CUresult number it answers with (CUDA_ERROR_INVALID_VALUE
// = 1, ...), so the emulated device and the real driver report failures the same way.
class DeviceError : public Error {
 public:
  DeviceError(const std::string& message, std::string call, int code)
      : Error(message), call_(std::move(call)), code_(code) {}
  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }

 private:
  std::string call_;
  int code_;
};

// CUresult values vmalloc uses (numbers from cuda.h), so errors carry the driver's codes.
namespace cu_result {
inline constexpr int success = 0;
inline constexpr int invalid_value = 1;
inline constexpr int out_of_memory = 2;
inline constexpr int not_initialized = 3;
inline constexpr int deinitialized = 4;
inline constexpr int no_device = 100;
inline constexpr int invalid_device = 101;
inline constexpr int invalid_context = 201;
inline constexpr int invalid_handle = 400;
inline constexpr int not_found = 500;
inline constexpr int not_ready = 600;
inline constexpr int illegal_address = 700;
inline constexpr int not_permitted = 800;
inline constexpr int not_supported = 801;
inline constexpr int unknown = 999;
}  // namespace cu_result

}  // namespace vmalloc
