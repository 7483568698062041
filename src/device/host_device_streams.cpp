// HostDevice: streams, events and host functions, handed to the device's StreamSet (which
// keeps the default stream's ordering and the faults of queued work); counted here as driver
// calls.
#include <exception>
#include <string>
#include <utility>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/device/detail/stream_set.hpp"
#include "vmalloc/device/host_device.hpp"

namespace vmalloc {

using detail::hex;

stream_t HostDevice::create_stream() { return create_stream(false); }

stream_t HostDevice::create_stream(bool non_blocking) {
  count(DriverCall::stream_create);
  return streams_->create_stream(non_blocking);
}

void HostDevice::check_stream_alive(stream_t stream, const char* caller) const {
  if (stream != 0 && streams_->destroyed(stream))
    throw InvalidArgument(std::string(caller) + ": stream " + hex(stream) + " of " + name() +
                          " was destroyed: allocating or freeing on it is refused");
}

void HostDevice::destroy_stream(stream_t stream) {
  count(DriverCall::stream_destroy);
  streams_->destroy_stream(stream, driver_call_entry_point(DriverCall::stream_destroy));
}

event_t HostDevice::create_event() {
  count(DriverCall::event_create);
  return streams_->create_event();
}

void HostDevice::destroy_event(event_t event) {
  count(DriverCall::event_destroy);
  streams_->destroy_event(event, driver_call_entry_point(DriverCall::event_destroy));
}

void HostDevice::record_event(event_t event, stream_t stream) {
  count(DriverCall::event_record);
  streams_->record(event, stream, driver_call_entry_point(DriverCall::event_record));
}

bool HostDevice::query_event(event_t event) {
  count(DriverCall::event_query);
  return streams_->query(event, driver_call_entry_point(DriverCall::event_query));
}

void HostDevice::synchronize_event(event_t event) {
  count(DriverCall::event_synchronize);
  const char* entry = driver_call_entry_point(DriverCall::event_synchronize);
  streams_->wait_event_host(event, entry);
  streams_->report_fault(entry);
}

void HostDevice::wait_event(stream_t stream, event_t event) {
  count(DriverCall::stream_wait_event);
  streams_->stream_wait_event(stream, event, driver_call_entry_point(DriverCall::stream_wait_event));
}

void HostDevice::synchronize_stream(stream_t stream) {
  count(DriverCall::stream_synchronize);
  const char* entry = driver_call_entry_point(DriverCall::stream_synchronize);
  streams_->synchronize_stream(stream, entry);
  streams_->report_fault(entry);
}

void HostDevice::synchronize() {
  count(DriverCall::synchronize);
  streams_->synchronize_all();
  streams_->report_fault(driver_call_entry_point(DriverCall::synchronize));
}

void HostDevice::launch_host_func(stream_t stream, std::function<void()> fn) {
  if (!fn)
    throw DeviceError("cuLaunchHostFunc on " + name() + ": the function is empty",
                      "cuLaunchHostFunc", cu_result::invalid_value);
  detail::StreamSet* streams = streams_.get();
  streams_->enqueue(
      stream,
      [streams, fn = std::move(fn)] {
        try {
          fn();
        } catch (const std::exception& e) {
          streams->record_fault(std::string("a host function failed: ") + e.what());
        } catch (...) {
          streams->record_fault("a host function failed");
        }
      },
      "cuLaunchHostFunc");
}

std::uint64_t HostDevice::hold_stream(stream_t stream) {
  return streams_->hold(stream, "cuLaunchHostFunc");
}

void HostDevice::release_hold(std::uint64_t hold) {
  streams_->release_hold(hold, "HostDevice::release_hold");
}

}  // namespace vmalloc
