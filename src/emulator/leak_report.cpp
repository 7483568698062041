// The leak report: every resource a program created through the driver and has not freed,
// one line each, so a test can assert it is empty and a human can see what leaked.
#include <cstdio>
#include <string>

#include "emulator.hpp"

namespace vmalloc::emulator {

std::string Emulator::leak_report(int only) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  std::string out;
  auto line = [&](int ordinal, const std::string& text) {
    out += "device " + std::to_string(ordinal) + ": " + text + "\n";
  };
  for (const auto& g : gpus_) {
    const int ordinal = g->ordinal;
    if (only >= 0 && ordinal != only) continue;
    if (g->primary_refs > 0)
      line(ordinal, "primary context retained " + std::to_string(g->primary_refs) +
                        " time(s), not released (cuDevicePrimaryCtxRelease)");
    for (const auto& [handle, a] : allocations_)
      if (a.ordinal == ordinal && !a.released)
        line(ordinal, "physical allocation handle " + std::to_string(handle) + " of " +
                          bytes(a.size) + " not released (cuMemRelease)");
    for (const auto& [ptr, r] : reservations_)
      if (r.ordinal == ordinal)
        line(ordinal, "reservation at " + hex(ptr) + " of " + bytes(r.size) +
                          " not freed (cuMemAddressFree)");
    for (const auto& [ptr, m] : mappings_) {
      auto a = allocations_.find(m.handle);
      if (a != allocations_.end() && a->second.ordinal == ordinal)
        line(ordinal, "mapping at " + hex(ptr) + " of " + bytes(m.size) + " (handle " +
                          std::to_string(m.handle) + ") not unmapped (cuMemUnmap)");
    }
    for (const auto& [ptr, h] : host_blocks_)
      if (h.ordinal == ordinal)
        line(ordinal, "pinned host memory at " + hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                          " of " + bytes(h.size) + " not freed (cuMemFreeHost)");
    for (const auto& [handle, s] : streams_)
      if (s.ordinal == ordinal)
        line(ordinal, "stream " + hex(handle) + " not destroyed (cuStreamDestroy)");
    for (const auto& [handle, e] : events_)
      if (e.ordinal == ordinal)
        line(ordinal, "event " + hex(handle) + " not destroyed (cuEventDestroy)");
    for (const auto& [misused_on, what] : misuses_)
      if (misused_on == ordinal) line(ordinal, "misuse: " + what);
  }
  return out;
}

void Emulator::write_exit_report() noexcept {
  try {
    const std::string report = leak_report(-1);
    if (!config_.leak_report_path.empty()) {
      // Written even when empty, so CI can assert "no leaks" by the file's size.
      if (std::FILE* f = std::fopen(config_.leak_report_path.c_str(), "w")) {
        std::fputs(report.c_str(), f);
        std::fclose(f);
      }
    }
    if (!report.empty())
      std::fprintf(stderr, "vmalloc driver emulator: leaked at exit:\n%s", report.c_str());
  } catch (...) {
  }
}

}  // namespace vmalloc::emulator
