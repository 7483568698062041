// Numbers as text for error messages and reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace vmalloc::detail {

// "0x7f3a00000000": an address, handle or stream in lowercase hex ("0x0" for 0).
std::string hex(std::uint64_t value);

// The one byte formatter of the C++ side: "512 B", "1.50 KiB", "2.00 GiB", binary units up
// to PiB with two decimals above bytes; with `exact`, a rounded figure is followed by the
// count ("2.00 MiB (2097152 bytes)"). vmalloc.sizes.format_size writes the same text on the
// Python side (tests/alloc/test_byte_format.py holds the two to it).
std::string human_bytes(std::size_t bytes, bool exact = false);

}  // namespace vmalloc::detail
