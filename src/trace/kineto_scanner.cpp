// The Kineto JSON scanner's streaming driver: see include/vmalloc/trace/kineto_scanner.hpp.
// Blocks of the file go in (feed), the top-level object is walked here (its scalar members
// kept as metadata), and each element of "traceEvents" goes to event() (kineto_events.cpp);
// the tokens are detail::JsonText's (json_tokens.hpp). It mirrors vmalloc/traces/kineto.py
// and _json_stream.py; where they could differ it bails out instead.
#include "vmalloc/trace/kineto_scanner.hpp"

#include <algorithm>
#include <cstring>

namespace vmalloc::trace_parse {
namespace {

// The largest trace event taken here (_json_stream refuses events of 16 Mi characters).
constexpr std::size_t max_json_event = 15u << 20;

enum State { s_start, s_obj_first, s_obj_member, s_obj_after, s_arr_first, s_arr_elem,
             s_arr_after, s_end };

}  // namespace

KinetoScanner::KinetoScanner(std::int64_t want_type, std::int64_t want_id)
    : want_type_(want_type), want_id_(want_id) {}

std::size_t KinetoScanner::count_device(std::int64_t type, std::int64_t id) {
  for (std::size_t i = 0; i < devices.size(); ++i) {
    auto& d = devices[i];
    if (d.first.first == type && d.first.second == id) {
      ++d.second;
      return i;
    }
  }
  devices.push_back({{type, id}, 1});
  if (want_type_ == count_devices && scans_ok) device_scans.emplace_back();
  return devices.size() - 1;
}

void KinetoScanner::drop_kept() {
  kept_dropped = true;
  kept_bytes = 0;
  for (auto& d : device_scans) std::vector<Events>().swap(d.kept);
}

// A top-level member other than traceEvents, from its name: kept if its value is a scalar.
KinetoScanner::R KinetoScanner::member(std::size_t& p) {
  const char* d = t_.d;
  if (d[p] != '"') return R::bail;
  std::size_t kb = p;
  bool kesc;
  R r = t_.string(p, kesc);
  if (r != R::ok) return r;
  std::size_t ke = p;
  if (kesc) return R::bail;
  if ((r = t_.ws(p)) != R::ok) return r;
  if (d[p] != ':') return R::bail;
  ++p;
  if ((r = t_.ws(p)) != R::ok) return r;
  if (ke - kb == 13 && std::memcmp(d + kb, "\"traceEvents\"", 13) == 0) {
    if (d[p] != '[') return R::bail;
    ++p;
    found_events_ = true;
    state_ = s_arr_first;
    in_object_ = true;
    return R::ok;
  }
  std::size_t vb = p;
  char c = d[p];
  if ((r = t_.skip(p, 1)) != R::ok) return r;
  if (c != '{' && c != '[')
    metadata.emplace_back(std::string(d + kb, ke - kb), std::string(d + vb, p - vb));
  state_ = s_obj_after;
  return R::ok;
}

KinetoScanner::R KinetoScanner::run(Events& out) {
  for (;;) {
    std::size_t p = pos_;
    R r = t_.ws(p);
    if (r == R::bail && state_ == s_end) return R::ok;  // whitespace to the end of the file
    if (r != R::ok) return r;
    char c = t_.d[p];
    switch (state_) {
      case s_start:
        if (c == '{') state_ = s_obj_first;
        else if (c == '[') state_ = s_arr_first;
        else return R::bail;
        ++p;
        break;
      case s_obj_first:
        if (c == '}') {
          ++p;
          state_ = s_end;
        } else {
          state_ = s_obj_member;
        }
        break;
      case s_obj_member:
        r = member(p);
        if (r == R::more && t_.n - pos_ > max_json_event) return R::bail;
        if (r != R::ok) return r;
        break;
      case s_obj_after:
        ++p;
        if (c == ',') state_ = s_obj_member;
        else if (c == '}') state_ = s_end;
        else return R::bail;
        break;
      case s_arr_first:
        if (c == ']') {
          ++p;
          state_ = in_object_ ? s_obj_after : s_end;
        } else {
          state_ = s_arr_elem;
        }
        break;
      case s_arr_elem: {
        std::size_t before = out.size();
        r = event(p, out);
        if (r == R::more) out.resize(before);
        if (r == R::more && t_.n - pos_ > max_json_event) return R::bail;
        if (r != R::ok) return r;
        state_ = s_arr_after;
        break;
      }
      case s_arr_after:
        ++p;
        if (c == ',') state_ = s_arr_elem;
        else if (c == ']') state_ = in_object_ ? s_obj_after : s_end;
        else return R::bail;
        break;
      case s_end:
        return R::bail;  // "unexpected data after the trace"
    }
    pos_ = p;
  }
}

bool KinetoScanner::feed(const char* data, std::size_t n, Events& out) {
  // An event cut by the end of the block is parsed again, whole, once the next block has
  // its end: event() counts and appends only once an event is complete, so nothing is
  // counted twice. Only that event's bytes are copied (buf_); the rest of the block is
  // parsed where the caller holds it.
  std::size_t from = 0;  // where in data the direct parse starts
  if (!buf_.empty()) {
    std::size_t carry = t_.n;  // pos_ == 0: feed() keeps only the unparsed tail
    std::size_t take = std::min(n, stitch_bytes);
    buf_.append(data, take);
    view(buf_);
    if (run(out) == R::bail) return false;
    if (pos_ < carry && take < n) {  // a longer event: the whole block, as it needs
      buf_.append(data + take, n - take);
      view(buf_);
      if (run(out) == R::bail) return false;
    }
    if (pos_ < carry) {  // still cut: all of the block is in buf_
      buf_.erase(0, pos_);
      pos_ = 0;
      return true;
    }
    from = pos_ - carry;
    buf_.clear();
  }
  t_.d = data;
  t_.n = n;
  pos_ = from;
  if (run(out) == R::bail) return false;
  buf_.assign(data + pos_, n - pos_);
  pos_ = 0;
  view(buf_);  // data is the caller's only until this returns
  return true;
}

bool KinetoScanner::finish(Events& out) {
  t_.eof = true;
  view(buf_);
  if (run(out) != R::ok) return false;
  for (auto& d : device_scans) {
    d.scan.feed(d.pending.data(), d.pending.size());
    Events().swap(d.pending);
  }
  if (state_ != s_end) return false;
  if (devices.empty()) return false;  // the Python reader words the error
  if (matched == 0 && want_type_ != count_devices) return false;
  return true;
}

}  // namespace vmalloc::trace_parse
