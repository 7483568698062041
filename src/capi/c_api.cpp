// The C ABI (include/vmalloc/c_api.h): every entry point catches everything, turns it into a
// vmalloc_status plus a thread-local message, and routes requests through the per-device
// current allocator registry (current_allocator.hpp).
#include "vmalloc/c_api.h"

#include <algorithm>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "vmalloc/alloc/current_allocator.hpp"
#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc {
namespace {

using detail::hex;

// ---- per-thread last error ----

struct LastError {
  int code = VMALLOC_SUCCESS;
  std::string message;
};

LastError& last_error() noexcept {
  thread_local LastError error;
  return error;
}

void set_error(int code, const char* where, const char* what) noexcept {
  LastError& e = last_error();
  e.code = code;
  try {
    e.message.assign(where).append(": ").append(what);
  } catch (...) {
    e.message.clear();  // host memory exhausted: the code alone has to do
  }
}

// Maps the exception being handled to a status and records it. Call only inside catch.
int record_current_exception(const char* where) noexcept {
  try {
    throw;
  } catch (const OutOfMemory& e) {
    set_error(VMALLOC_ERROR_OUT_OF_MEMORY, where, e.what());
    return VMALLOC_ERROR_OUT_OF_MEMORY;
  } catch (const InvalidPointer& e) {
    set_error(VMALLOC_ERROR_INVALID_POINTER, where, e.what());
    return VMALLOC_ERROR_INVALID_POINTER;
  } catch (const InvalidArgument& e) {
    set_error(VMALLOC_ERROR_INVALID_ARGUMENT, where, e.what());
    return VMALLOC_ERROR_INVALID_ARGUMENT;
  } catch (const DeviceError& e) {
    set_error(VMALLOC_ERROR_DEVICE, where, e.what());
    return VMALLOC_ERROR_DEVICE;
  } catch (const std::bad_alloc&) {
    set_error(VMALLOC_ERROR_INTERNAL, where, "host memory exhausted");
    return VMALLOC_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    set_error(VMALLOC_ERROR_INTERNAL, where, e.what());
    return VMALLOC_ERROR_INTERNAL;
  } catch (...) {
    set_error(VMALLOC_ERROR_INTERNAL, where, "unknown C++ exception");
    return VMALLOC_ERROR_INTERNAL;
  }
}

// Thrown inside this file only: a device without a current allocator.
class NoAllocator : public Error {
 public:
  using Error::Error;
};

std::shared_ptr<Allocator> allocator_for(int device) {
  std::shared_ptr<Allocator> a = current_allocator(device);
  if (!a)
    throw NoAllocator("no current allocator for device " + std::to_string(device) +
                      " (set one with vmalloc.set_current_allocator(allocator, device=" +
                      std::to_string(device) + "))");
  return a;
}

// Runs `body` and converts whatever it throws; returns VMALLOC_SUCCESS or the failure's status.
template <class Body>
int guarded(const char* where, Body&& body) noexcept {
  try {
    body();
    return VMALLOC_SUCCESS;
  } catch (const NoAllocator& e) {
    set_error(VMALLOC_ERROR_NO_ALLOCATOR, where, e.what());
    return VMALLOC_ERROR_NO_ALLOCATOR;
  } catch (...) {
    return record_current_exception(where);
  }
}

// ---- allocations made through the ABI ----

// Each allocation made through the ABI keeps its allocator (so frees reach the right one
// after the current allocator changed, and the allocator outlives its allocations) and the
// extra streams that use it (record_stream).
struct AbiAllocation {
  std::shared_ptr<Allocator> owner;
  std::size_t size = 0;
  std::vector<stream_t> users;  // streams other than the allocation stream
};

class AbiAllocations {
 public:
  device_ptr allocate(int device, std::size_t size, stream_t stream) {
    if (size == 0) return 0;
    std::shared_ptr<Allocator> a = allocator_for(device);
    device_ptr p = a->allocate(size, stream);
    if (p == 0) return 0;
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      AbiAllocation& entry = live_[p];  // overwrites a stale entry freed behind the ABI's back
      entry.owner = a;
      entry.size = size;
      entry.users.clear();
    } catch (...) {
      // Host memory for the record ran out: give the memory back rather than leak it.
      try {
        a->deallocate(p, size, stream);
      } catch (...) {
      }
      throw;
    }
    return p;
  }

  void deallocate(int device, device_ptr p, std::size_t size, stream_t stream) {
    if (p == 0) return;
    AbiAllocation entry;
    bool found = false;
    {
      // Taken out before the allocator frees it, so that a concurrent allocate that gets the
      // same address back cannot have its entry erased by this free.
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        entry = std::move(it->second);
        live_.erase(it);
        found = true;
      }
    }
    if (!found) {
      // Not made through the ABI (or a bad pointer): the device's current allocator decides.
      allocator_for(device)->deallocate(p, size, stream);
      return;
    }
    try {
      wait_for_users(*entry.owner, stream, entry.users);
      entry.owner->deallocate(p, size == unknown_size ? entry.size : size, stream);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(p, std::move(entry));  // nothing changed: the allocation stays live
      throw;
    }
  }

  void record_stream(device_ptr p, stream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(p);
    if (it == live_.end())
      throw InvalidPointer("pointer " + hex(p) +
                           " is not a live allocation made through the vmalloc C ABI");
    auto& users = it->second.users;
    if (std::find(users.begin(), users.end(), stream) == users.end()) users.push_back(stream);
  }

 private:
  // Makes `stream` wait for the work queued so far on each user stream, so that freeing on
  // `stream` covers their use too. Falls back to waiting on the host if events fail.
  static void wait_for_users(Allocator& a, stream_t stream, const std::vector<stream_t>& users) {
    if (users.empty()) return;
    Device& d = *a.device();
    try {
      for (stream_t user : users) {
        if (user == stream) continue;
        event_t e = d.create_event();
        try {
          d.record_event(e, user);
          d.wait_event(stream, e);
        } catch (...) {
          d.destroy_event(e);
          throw;
        }
        d.destroy_event(e);  // legal while the wait is pending, as in CUDA
      }
    } catch (const Error&) {
      for (stream_t user : users)
        if (user != stream) d.synchronize_stream(user);
    }
  }

  std::mutex mutex_;
  std::unordered_map<device_ptr, AbiAllocation> live_;
};

AbiAllocations& abi_allocations() {
  static AbiAllocations instance;
  return instance;
}

// device -1: every device with a current allocator.
std::size_t release_cached(int device) {
  if (device != -1) return allocator_for(device)->release_cached();
  std::size_t total = 0;
  for (int d : devices_with_current_allocator())
    if (auto a = current_allocator(d)) total += a->release_cached();
  return total;
}

stream_t to_stream(void* stream) noexcept { return reinterpret_cast<stream_t>(stream); }
device_ptr to_ptr(void* ptr) noexcept { return reinterpret_cast<device_ptr>(ptr); }
void* from_ptr(device_ptr p) noexcept { return reinterpret_cast<void*>(p); }

using AllocatorRef = std::shared_ptr<Allocator>;

}  // namespace
}  // namespace vmalloc

using vmalloc::guarded;

// The opaque handle is a heap-held shared_ptr.
struct vmalloc_allocator {
  vmalloc::AllocatorRef ref;
};

extern "C" {

int vmalloc_abi_version(void) { return VMALLOC_C_API_VERSION; }

const char* vmalloc_last_error(void) { return vmalloc::last_error().message.c_str(); }

int vmalloc_last_error_code(void) { return vmalloc::last_error().code; }

void vmalloc_clear_last_error(void) {
  vmalloc::LastError& e = vmalloc::last_error();
  e.code = VMALLOC_SUCCESS;
  e.message.clear();
}

vmalloc_allocator* vmalloc_get_current_allocator(int device) {
  vmalloc_allocator* handle = nullptr;
  guarded("vmalloc_get_current_allocator",
          [&] { handle = new vmalloc_allocator{vmalloc::allocator_for(device)}; });
  return handle;
}

int vmalloc_set_current_allocator(int device, vmalloc_allocator* allocator) {
  return guarded("vmalloc_set_current_allocator", [&] {
    // The replaced allocator is dropped here, outside the registry's lock.
    vmalloc::set_current_allocator(device, allocator ? allocator->ref : nullptr);
  });
}

void vmalloc_allocator_release(vmalloc_allocator* allocator) {
  guarded("vmalloc_allocator_release", [&] { delete allocator; });
}

void* vmalloc_allocate(int device, size_t size, void* stream) {
  vmalloc::device_ptr p = 0;
  guarded("vmalloc_allocate", [&] {
    p = vmalloc::abi_allocations().allocate(device, size, vmalloc::to_stream(stream));
  });
  return vmalloc::from_ptr(p);
}

int vmalloc_deallocate(int device, void* ptr, size_t size, void* stream) {
  return guarded("vmalloc_deallocate", [&] {
    vmalloc::abi_allocations().deallocate(device, vmalloc::to_ptr(ptr), size,
                                          vmalloc::to_stream(stream));
  });
}

int vmalloc_record_stream(void* ptr, void* stream) {
  return guarded("vmalloc_record_stream", [&] {
    vmalloc::abi_allocations().record_stream(vmalloc::to_ptr(ptr), vmalloc::to_stream(stream));
  });
}

int vmalloc_get_stats(int device, vmalloc_stats* out) {
  return guarded("vmalloc_get_stats", [&] {
    if (out == nullptr) throw vmalloc::InvalidArgument("the stats output pointer is NULL");
    const vmalloc::Stats s = vmalloc::allocator_for(device)->stats();
    *out = vmalloc_stats{s.requested_bytes,
                         s.peak_requested_bytes,
                         s.reserved_bytes,
                         s.peak_reserved_bytes,
                         s.allocated_bytes,
                         s.peak_allocated_bytes,
                         s.internal_fragmentation_bytes,
                         s.peak_internal_fragmentation_bytes,
                         s.cached_bytes,
                         s.live_allocations,
                         s.peak_live_allocations,
                         s.total_allocations,
                         s.total_deallocations,
                         s.out_of_memory_count};
  });
}

int vmalloc_reset_peak_stats(int device) {
  return guarded("vmalloc_reset_peak_stats",
                 [&] { vmalloc::allocator_for(device)->reset_peak_stats(); });
}

int vmalloc_release_cached(int device, size_t* released) {
  return guarded("vmalloc_release_cached", [&] {
    std::size_t total = vmalloc::release_cached(device);
    if (released) *released = total;
  });
}

void* vmalloc_torch_alloc(ssize_t size, int device, void* stream) {
  vmalloc::device_ptr p = 0;
  guarded("vmalloc_torch_alloc", [&] {
    if (size < 0)
      throw vmalloc::InvalidArgument("size " + std::to_string(size) + " is negative");
    p = vmalloc::abi_allocations().allocate(device, static_cast<std::size_t>(size),
                                            vmalloc::to_stream(stream));
  });
  return vmalloc::from_ptr(p);
}

void vmalloc_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  guarded("vmalloc_torch_free", [&] {
    if (size < 0)
      throw vmalloc::InvalidArgument("size " + std::to_string(size) + " is negative");
    vmalloc::abi_allocations().deallocate(device, vmalloc::to_ptr(ptr),
                                          static_cast<std::size_t>(size),
                                          vmalloc::to_stream(stream));
  });
}

void vmalloc_torch_record_stream(void* ptr, void* stream) {
  guarded("vmalloc_torch_record_stream", [&] {
    vmalloc::abi_allocations().record_stream(vmalloc::to_ptr(ptr), vmalloc::to_stream(stream));
  });
}

void vmalloc_torch_empty_cache(void) {
  guarded("vmalloc_torch_empty_cache", [] { vmalloc::release_cached(-1); });
}

void* vmalloc_cupy_malloc(void* param, size_t size, int device_id) {
  vmalloc::device_ptr p = 0;
  guarded("vmalloc_cupy_malloc", [&] {
    p = vmalloc::abi_allocations().allocate(device_id, size, vmalloc::to_stream(param));
  });
  return vmalloc::from_ptr(p);
}

void vmalloc_cupy_free(void* param, void* ptr, int device_id) {
  guarded("vmalloc_cupy_free", [&] {
    vmalloc::abi_allocations().deallocate(device_id, vmalloc::to_ptr(ptr),
                                          vmalloc::unknown_size, vmalloc::to_stream(param));
  });
}

}  // extern "C"
