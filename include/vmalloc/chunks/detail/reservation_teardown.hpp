// Tearing down the reservations of a chunk-mapping allocator at destruction: wait for the
// device (work queued on the memory must finish before it is unmapped), one unmap per maximal
// run of mapped slots (a cuMemUnmap may span adjacent mappings), then free the address range.
// Errors are swallowed: a destructor cannot report them, and the rest must still be freed.
#pragma once

#include <cstddef>

#include "vmalloc/device/device.hpp"

namespace vmalloc::detail {

// `reservations`: a map whose values point to reservations with `base`, `slots` and
// `handles` (per slot, 0 = unmapped), each slot `chunk_size` bytes.
template <class Reservations>
void tear_down_reservations(Device& device, const Reservations& reservations,
                            std::size_t chunk_size) noexcept {
  try {
    device.synchronize();
  } catch (...) {
  }
  for (const auto& entry : reservations) {
    const auto& res = *entry.second;
    for (std::size_t i = 0; i < res.slots;) {
      if (res.handles[i] == 0) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < res.slots && res.handles[j] != 0) ++j;
      try {
        device.unmap(res.base + i * chunk_size, (j - i) * chunk_size);
      } catch (...) {
      }
      i = j;
    }
    try {
      device.free_address(res.base, res.slots * chunk_size);
    } catch (...) {
    }
  }
}

}  // namespace vmalloc::detail
