#include "faults.hpp"

#include <cstdlib>
#include <limits>

namespace vmalloc::emulator {

using namespace vmalloc::driver;

namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\n");
  if (begin == std::string::npos) return {};
  const auto end = s.find_last_not_of(" \t\n");
  return s.substr(begin, end - begin + 1);
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  std::string::size_type start = 0;
  while (true) {
    const auto at = s.find(separator, start);
    parts.push_back(trim(s.substr(start, at == std::string::npos ? std::string::npos : at - start)));
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return parts;
}

bool parse_count(const std::string& text, std::uint64_t* value) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) return false;
  char* end = nullptr;
  *value = std::strtoull(text.c_str(), &end, 10);
  return end != nullptr && *end == '\0';
}

}  // namespace

bool parse_cu_result(const std::string& text, CUresult* code) noexcept {
  if (text.empty()) return false;
  if (text.find_first_not_of("0123456789") == std::string::npos) {
    const unsigned long value = std::strtoul(text.c_str(), nullptr, 10);
    if (value > static_cast<unsigned long>(std::numeric_limits<int>::max())) return false;
    *code = static_cast<CUresult>(value);
    return true;
  }
  for (CUresult candidate = 0; candidate <= 1000; ++candidate) {
    const char* name = cu_result_name_or_null(candidate);
    if (name != nullptr && text == name) {
      *code = candidate;
      return true;
    }
  }
  return false;
}

void FaultPlan::arm(EntryPoint entry, std::uint64_t nth, CUresult code, std::uint64_t count,
                    std::uint64_t calls_so_far) {
  const std::uint64_t first = calls_so_far + (nth == 0 ? 1 : nth);
  const std::uint64_t last =
      count == 0 ? std::numeric_limits<std::uint64_t>::max() : first + count - 1;
  std::lock_guard<std::mutex> lock(mutex_);
  faults_.push_back(Fault{entry, first, last, code});
  armed_.store(true, std::memory_order_release);
}

std::string FaultPlan::arm_spec(const std::string& spec, const CallCounts& counts) {
  struct Parsed {
    EntryPoint entry;
    std::uint64_t nth, count;
    CUresult code;
  };
  std::vector<Parsed> parsed;
  for (const std::string& item : split(spec, ',')) {
    if (item.empty()) continue;
    const std::vector<std::string> fields = split(item, ':');
    Parsed p{};
    if (fields.size() < 3 || fields.size() > 4)
      return "fault '" + item + "' is not entry:nth:code[:count] (e.g. cuMemMap:3:2)";
    if (!find_entry_point(fields[0], &p.entry))
      return "fault '" + item + "': '" + fields[0] + "' is not an entry point of the emulator";
    if (!parse_count(fields[1], &p.nth) || p.nth == 0)
      return "fault '" + item + "': nth must be a call number >= 1, got '" + fields[1] + "'";
    if (!parse_cu_result(fields[2], &p.code) || p.code == CUDA_SUCCESS)
      return "fault '" + item + "': '" + fields[2] +
             "' is not a failing CUresult (a number, or a name like CUDA_ERROR_OUT_OF_MEMORY)";
    p.count = 1;
    if (fields.size() == 4 && fields[3] == "*")
      p.count = 0;
    else if (fields.size() == 4 && !parse_count(fields[3], &p.count))
      return "fault '" + item + "': count must be a number or *, got '" + fields[3] + "'";
    parsed.push_back(p);
  }
  for (const Parsed& p : parsed) arm(p.entry, p.nth, p.code, p.count, counts.get(p.entry));
  return {};
}

void FaultPlan::clear() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  faults_.clear();
  armed_.store(false, std::memory_order_release);
}

CUresult FaultPlan::check(EntryPoint entry, std::uint64_t call) noexcept {
  if (empty()) return CUDA_SUCCESS;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Fault& f : faults_)
    if (f.entry == entry && call >= f.first_call && call <= f.last_call) return f.code;
  return CUDA_SUCCESS;
}

}  // namespace vmalloc::emulator
