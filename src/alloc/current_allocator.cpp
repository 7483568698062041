#include "vmalloc/alloc/current_allocator.hpp"

#include <mutex>
#include <string>
#include <utility>

#include "vmalloc/base/errors.hpp"

namespace vmalloc {

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Allocator>> by_device;  // index = ordinal, grown on demand
};

// Function-local static: constructed on first use, so the C ABI works from any other
// library's static initializers too. The Python package clears it at interpreter exit, so
// allocators are destroyed while their devices can still be used.
Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

std::shared_ptr<Allocator> set_current_allocator(int device,
                                                 std::shared_ptr<Allocator> allocator) {
  if (device < 0 || device >= max_registry_devices)
    throw InvalidArgument("device ordinal " + std::to_string(device) + " is out of range [0, " +
                          std::to_string(max_registry_devices) + ")");
  Registry& r = registry();
  std::shared_ptr<Allocator> previous;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto index = static_cast<std::size_t>(device);
    if (index >= r.by_device.size()) {
      if (!allocator) return nullptr;  // clearing a device never set: nothing to do
      r.by_device.resize(index + 1);
    }
    previous = std::exchange(r.by_device[index], std::move(allocator));
  }
  // `previous` is returned, so if the caller drops it, the allocator's destructor runs
  // outside the registry's lock.
  return previous;
}

std::shared_ptr<Allocator> current_allocator(int device) noexcept {
  if (device < 0) return nullptr;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto index = static_cast<std::size_t>(device);
  return index < r.by_device.size() ? r.by_device[index] : nullptr;
}

std::vector<int> devices_with_current_allocator() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<int> devices;
  for (std::size_t i = 0; i < r.by_device.size(); ++i)
    if (r.by_device[i]) devices.push_back(static_cast<int>(i));
  return devices;
}

}  // namespace vmalloc
