#include "vmalloc/device/detail/cuda_driver.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "vmalloc/base/errors.hpp"

namespace vmalloc::driver {

namespace {

struct ResultInfo {
  CUresult code;
  const char* name;
  const char* description;  // as the driver's cuGetErrorString words it
};

constexpr ResultInfo result_info[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ResultInfo* find_result(CUresult result) noexcept {
  for (const auto& info : result_info)
    if (info.code == result) return &info;
  return nullptr;
}

constexpr const char* entry_point_symbols[] = {
#define VMALLOC_CUDA_SYMBOL(member, symbol, params) symbol,
    VMALLOC_CUDA_ENTRY_POINTS(VMALLOC_CUDA_SYMBOL)
#undef VMALLOC_CUDA_SYMBOL
};

std::unique_ptr<DriverApi> open_driver(const std::string& path) {
  // RTLD_LOCAL: the driver's symbols must not interpose on anything else in the process.
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    throw DeviceError("cannot load the CUDA driver library '" + path + "': " +
                          (why ? why : "unknown dlopen error") +
                          " (no NVIDIA driver here? set VMALLOC_LIBCUDA to its path, or use "
                          "vmalloc.testing.emulated_cuda_device() to run on the driver emulator)",
                      "dlopen", CUDA_ERROR_NO_DEVICE);
  }
  auto api = std::make_unique<DriverApi>();
  api->path = path;
  auto resolve = [&](const char* symbol) {
    void* address = dlsym(library, symbol);
    if (address == nullptr) {
      // Never dlclose: a half-initialized driver is better left alone than unloaded.
      throw DeviceError("the CUDA driver library '" + path + "' does not export " + symbol +
                            " (driver too old for the virtual memory API?)",
                        "dlsym", CUDA_ERROR_NOT_FOUND);
    }
    return address;
  };
#define VMALLOC_CUDA_RESOLVE(member, symbol, params) \
  api->member = reinterpret_cast<decltype(api->member)>(resolve(symbol));
  VMALLOC_CUDA_ENTRY_POINTS(VMALLOC_CUDA_RESOLVE)
#undef VMALLOC_CUDA_RESOLVE
  api->emulator_last_error = reinterpret_cast<std::size_t (*)(char*, std::size_t)>(
      dlsym(library, "vmallocEmulatorLastError"));
  return api;
}

}  // namespace

std::string default_driver_library() {
  const char* path = std::getenv("VMALLOC_LIBCUDA");
  return path != nullptr && *path != '\0' ? path : "libcuda.so.1";
}

const DriverApi& load_driver(const std::string& path) {
  // One table per path for the life of the process: the driver is never unloaded.
  static std::mutex mutex;
  static auto* loaded = new std::map<std::string, std::unique_ptr<DriverApi>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded->find(path);
  if (it == loaded->end()) it = loaded->emplace(path, open_driver(path)).first;
  return *it->second;
}

std::vector<std::string> driver_entry_point_symbols() {
  std::vector<std::string> names;
  for (const char* symbol : entry_point_symbols) names.emplace_back(symbol);
  return names;
}

std::string cu_result_name(CUresult result) {
  const ResultInfo* info = find_result(result);
  return info ? info->name : "CUresult " + std::to_string(result);
}

const char* cu_result_description(CUresult result) noexcept {
  const ResultInfo* info = find_result(result);
  return info ? info->description : nullptr;
}

const char* cu_result_name_or_null(CUresult result) noexcept {
  const ResultInfo* info = find_result(result);
  return info ? info->name : nullptr;
}

}  // namespace vmalloc::driver
