// The per-device current allocator (like RMM's per-device memory resource): the allocator
// that the C ABI (c_api.h), and through it PyTorch and CuPy, route a device's requests to.
//
// Thread-safe. The registry holds a shared_ptr, so an allocator stays alive while it is
// current even if every other owner lets go of it.
#pragma once

#include <memory>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"

namespace vmalloc {

// Device ordinals the registry accepts: 0 <= device < max_registry_devices. Far above any
// machine's GPU count; a bound keeps a garbage ordinal from growing the table.
inline constexpr int max_registry_devices = 1024;

// Makes `allocator` the current allocator of `device` and returns the one it replaces (null
// when there was none). A null `allocator` clears the device. Throws InvalidArgument for an
// ordinal outside [0, max_registry_devices); nothing changes then.
std::shared_ptr<Allocator> set_current_allocator(int device, std::shared_ptr<Allocator> allocator);

// The current allocator of `device`, or null when none is set (or the ordinal is out of range).
std::shared_ptr<Allocator> current_allocator(int device) noexcept;

// Ordinals that have a current allocator, ascending.
std::vector<int> devices_with_current_allocator();

}  // namespace vmalloc
