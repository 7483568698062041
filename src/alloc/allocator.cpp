#include "vmalloc/alloc/allocator.hpp"

#include "vmalloc/base/errors.hpp"

namespace vmalloc {

std::vector<std::pair<device_ptr, std::size_t>> Allocator::live_allocations() const {
  throw InvalidArgument("allocator \"" + name() + "\" cannot list its live allocations");
}

}  // namespace vmalloc
