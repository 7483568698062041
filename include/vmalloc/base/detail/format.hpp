// Numbers as text for error messages and reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace vmalloc::detail {

// "0x7f3a00000000": an address, handle or stream in lowercase hex ("0x0" for 0).
std::string hex(std::uint64_t value);

// "512B", "1.50KiB", "2.00GiB": binary units up to PiB, two decimals above bytes.
std::string human_bytes(std::size_t bytes);

}  // namespace vmalloc::detail
