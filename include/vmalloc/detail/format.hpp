// Numbers as text for error messages and reports.
#pragma once

#include <cstdint>
#include <string>

namespace vmalloc::detail {

// "0x7f3a00000000": an address, handle or stream in lowercase hex ("0x0" for 0).
std::string hex(std::uint64_t value);

}  // namespace vmalloc::detail
