// The names of the emulator's entry points (exported symbol and cuda.h name), for lookups by
// name from fault specs and the control functions. The exported functions are in driver_api.cpp.
#include "entry_point_table.hpp"

#include <cstring>

namespace vmalloc::emulator {

namespace {
struct Names {
  const char* symbol;
  const char* header_name;  // the name cuda.h code writes
};
constexpr Names names[entry_point_count] = {
#define VMALLOC_EMULATOR_NAMES(member, symbol, params) {symbol, #member},
    VMALLOC_EMULATOR_ENTRY_POINTS(VMALLOC_EMULATOR_NAMES)
#undef VMALLOC_EMULATOR_NAMES
};
}  // namespace

const char* entry_point_symbol(EntryPoint entry) noexcept {
  auto i = static_cast<std::size_t>(entry);
  return i < entry_point_count ? names[i].symbol : "?";
}

bool find_entry_point(const std::string& name, EntryPoint* entry) noexcept {
  for (std::size_t i = 0; i < entry_point_count; ++i) {
    if (name == names[i].symbol || name == names[i].header_name) {
      *entry = static_cast<EntryPoint>(i);
      return true;
    }
  }
  return false;
}

}  // namespace vmalloc::emulator
