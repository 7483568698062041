// The calling thread's stack of current contexts (top = current).
#pragma once

#include <vector>

#include "vmalloc/device/detail/cuda_driver.hpp"

namespace vmalloc::emulator {

std::vector<driver::CUcontext>& context_stack();

}  // namespace vmalloc::emulator
