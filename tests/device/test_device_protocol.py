"""The Device protocol: one suite run over every device kind (HostDevice and CudaDevice on the
driver emulator), as RMM runs its typed suites over every resource.

What a device promises the layers above it (chunks, allocators, the swap manager) is checked
here once, with exact values; what only one device has (the emulator's driver loading, the
host device's VMA limit) stays in that device's own tests.
"""

import ctypes

import pytest

from vmalloc import DeviceError, OutOfMemoryError

MiB = 1 << 20
G = 2 * MiB
CAPACITY = 64 * MiB

INVALID_VALUE = 1
NOT_SUPPORTED = 801

#: The resources both devices account, under HostDevice.state()'s names.
RESOURCES = ("physical_allocations", "released_still_mapped", "bytes_created", "reservations",
             "bytes_reserved", "mappings", "bytes_mapped", "host_allocations", "host_bytes",
             "streams", "events")


def on_a_real_gpu(dev):
    """A CudaDevice over the real driver (scripts/gpu-check's ``cuda`` kind), not the
    emulator: it cannot list what it holds, and its capacity is the GPU's memory."""
    if hasattr(dev, "state"):
        return False
    from vmalloc import testing

    return dev.library != testing.emulated_driver_path()


def resources(dev):
    """What the device holds, from the device itself (host) or the driver emulator (cuda);
    on a real GPU nothing can list it: an empty dict, so the comparisons still run."""
    if on_a_real_gpu(dev):
        return {}
    if hasattr(dev, "state"):
        state = dev.state()
    else:
        from vmalloc import testing

        state = dict(testing.emulator().device_state(dev.ordinal))
        state["physical_allocations"] = state.pop("handles")
    return {key: state[key] for key in RESOURCES}


@pytest.fixture
def dev(make_device):
    device = make_device(capacity=CAPACITY, granularity=G)
    yield device
    # Every test gives back what it made: the protocol includes being able to.
    assert not any(resources(device).values()), resources(device)


def mapped(dev, size=G):
    handle = dev.create(size)
    ptr = dev.reserve(2 * size)
    dev.map(ptr, size, handle)
    dev.set_access(ptr, size)
    return ptr, handle


def free_mapped(dev, ptr, handle, size=G):
    dev.unmap(ptr, size)
    dev.release(handle)
    dev.free_address(ptr, 2 * size)


# --- properties and data ----------------------------------------------------------------------

def test_properties_start_empty(dev):
    assert dev.granularity == G
    # A real GPU's capacity is its memory, not the one asked for.
    assert dev.capacity == CAPACITY or (on_a_real_gpu(dev) and dev.capacity > CAPACITY)
    assert dev.physical_bytes_in_use == 0
    counters = dev.counters()
    assert set(counters) >= {"create", "release", "reserve", "free_address", "map", "unmap",
                             "set_access", "copy_to_device", "copy_to_host", "copy_device",
                             "memory_management_calls", "modeled_seconds"}
    assert not any(counters.values())
    assert dev.name.endswith(f":{dev.ordinal}")


def test_remap_keeps_bytes_and_needs_access_again(dev):
    ptr, handle = mapped(dev)
    dev.write(ptr + 10, b"chunk bytes")
    dev.unmap(ptr, G)
    other = dev.reserve(G)
    dev.map(other, G, handle)
    with pytest.raises(DeviceError) as info:
        dev.read(other, 4)
    assert (info.value.call, info.value.code) == ("cuMemcpyDtoHAsync", INVALID_VALUE)
    dev.set_access(other, G)
    assert dev.read(other + 10, 11) == b"chunk bytes"
    dev.unmap(other, G)
    dev.release(handle)
    dev.free_address(other, G)
    dev.free_address(ptr, 2 * G)


def test_two_mappings_of_one_handle_share_bytes(dev):
    handle = dev.create(G)
    a, b = dev.reserve(G), dev.reserve(G)
    for p in (a, b):
        dev.map(p, G, handle)
        dev.set_access(p, G)
    dev.write(a + 100, b"shared")
    assert dev.read(b + 100, 6) == b"shared"
    assert dev.physical_bytes_in_use == G
    for p in (a, b):
        dev.unmap(p, G)
        dev.free_address(p, G)
    dev.release(handle)


def test_release_while_mapped_keeps_bytes_until_unmapped(dev):
    ptr, handle = mapped(dev)
    dev.write(ptr, b"kept")
    dev.release(handle)
    assert resources(dev).get("released_still_mapped", 1) == 1
    assert dev.physical_bytes_in_use == G
    assert dev.read(ptr, 4) == b"kept"
    dev.unmap(ptr, G)
    assert dev.physical_bytes_in_use == 0
    assert resources(dev).get("released_still_mapped", 0) == 0
    dev.free_address(ptr, 2 * G)


def test_resources_are_counted_exactly(dev):
    if on_a_real_gpu(dev):
        pytest.skip("a real driver cannot list the resources it holds")
    ptr, handle = mapped(dev, 2 * G)
    assert resources(dev) == {
        "physical_allocations": 1, "released_still_mapped": 0, "bytes_created": 2 * G,
        "reservations": 1, "bytes_reserved": 4 * G, "mappings": 1, "bytes_mapped": 2 * G,
        "host_allocations": 0, "host_bytes": 0, "streams": 0, "events": 0}
    free_mapped(dev, ptr, handle, 2 * G)


# --- every rule, refused with the driver's code and no change ---------------------------------

def test_every_rule_is_refused_with_the_same_call_and_code_and_changes_nothing(dev):
    handle, big = dev.create(G), dev.create(2 * G)
    ptr = dev.reserve(4 * G)
    dev.map(ptr, G, handle)
    # The codes a real driver gives (scripts/gpucheck/rules.py on an H200, driver 580.159):
    # an unaligned address to cuMemMap is NOT_SUPPORTED, every other rule INVALID_VALUE.
    attempts = [
        ("create", lambda: dev.create(G + 4096), "cuMemCreate", INVALID_VALUE),
        ("reserve", lambda: dev.reserve(G, alignment=3 * MiB), "cuMemAddressReserve",
         INVALID_VALUE),
        ("map", lambda: dev.map(ptr, G, handle), "cuMemMap", INVALID_VALUE),  # mapped there
        ("map", lambda: dev.map(ptr + 4096, G, big), "cuMemMap", NOT_SUPPORTED),  # unaligned
        ("unmap", lambda: dev.unmap(ptr + 4096, G), "cuMemUnmap", INVALID_VALUE),
        ("set_access", lambda: dev.set_access(ptr, 2 * G), "cuMemSetAccess",  # a gap
         INVALID_VALUE),
        ("free_address", lambda: dev.free_address(ptr, 4 * G), "cuMemAddressFree",  # mapped
         INVALID_VALUE),
        ("free_address", lambda: dev.free_address(ptr + G, 3 * G), "cuMemAddressFree",
         INVALID_VALUE),
        ("release", lambda: dev.release(12345), "cuMemRelease", INVALID_VALUE),
    ]
    if not on_a_real_gpu(dev):
        # Past the reservation: a real driver (580.159, H200) mapped it when the addresses
        # beyond happened to be its own; the emulator refuses, as the documentation asks.
        attempts.insert(4, ("map", lambda: dev.map(ptr + 3 * G, 2 * G, big), "cuMemMap",
                            INVALID_VALUE))
    for counter, attempt, call, code in attempts:
        before, counted = resources(dev), dev.counters()
        with pytest.raises(DeviceError) as info:
            attempt()
        assert (info.value.call, info.value.code) == (call, code), call
        assert resources(dev) == before, call
        after = dev.counters()
        assert after[counter] == counted[counter] + 1, call  # failed calls are counted too
        assert after["memory_management_calls"] == counted["memory_management_calls"] + 1
    dev.unmap(ptr, G)
    dev.release(handle)
    dev.release(big)
    dev.free_address(ptr, 4 * G)


def test_reading_unmapped_or_inaccessible_memory_is_refused_at_once(dev):
    # CUDA_ERROR_INVALID_VALUE when the copy is issued, as a real driver answers (H200,
    # 580.159); a range unmapped under a queued copy faults later (tests/device's streams).
    handle = dev.create(G)
    ptr = dev.reserve(2 * G)
    dev.map(ptr, G, handle)
    for address in (ptr, ptr + G):  # mapped without access; not mapped at all
        with pytest.raises(DeviceError) as info:
            dev.read(address, 1)
        assert (info.value.call, info.value.code) == ("cuMemcpyDtoHAsync", INVALID_VALUE)
    dev.set_access(ptr, G)
    with pytest.raises(DeviceError) as info:
        dev.read(ptr + G - 2, 4)  # runs off the end of the mapping
    assert info.value.code == INVALID_VALUE
    dev.unmap(ptr, G)
    dev.release(handle)
    dev.free_address(ptr, 2 * G)


# --- capacity ---------------------------------------------------------------------------------

def test_out_of_memory_names_the_request_and_recovers(dev):
    handles = [dev.create(16 * MiB) for _ in range(4)]
    before = resources(dev)
    with pytest.raises(OutOfMemoryError) as info:
        dev.create(G)
    assert info.value.requested_bytes == G
    assert resources(dev) == before
    assert dev.physical_bytes_in_use == CAPACITY
    dev.release(handles.pop())
    handles.append(dev.create(G))
    assert dev.physical_bytes_in_use == 48 * MiB + G
    for h in handles:
        dev.release(h)


def test_released_but_mapped_memory_still_counts_against_capacity(dev):
    handles = [dev.create(16 * MiB) for _ in range(3)]
    ptr = dev.reserve(16 * MiB)
    last = dev.create(16 * MiB)
    dev.map(ptr, 16 * MiB, last)
    dev.release(last)
    with pytest.raises(OutOfMemoryError):
        dev.create(G)
    dev.unmap(ptr, 16 * MiB)
    handles.append(dev.create(16 * MiB))
    for h in handles:
        dev.release(h)
    dev.free_address(ptr, 16 * MiB)


# --- streams, events, copies, counters --------------------------------------------------------

def test_streams_events_and_copies_are_ordered(dev):
    ptr, handle = mapped(dev, 4 * G)
    s1, s2 = dev.create_stream(), dev.create_stream()
    assert isinstance(s1, int) and s1 != s2 and s1 != 0
    event = dev.create_event()
    assert dev.query_event(event)  # never recorded: complete
    host = dev.host_alloc(4 * MiB)
    ctypes.memmove(host, b"x" * 64, 64)
    dev.copy_to_device(ptr, host, 4 * MiB, s1)
    dev.record_event(event, s1)
    dev.wait_event(s2, event)
    dev.copy_device(ptr + 4 * MiB, ptr, 64, s2)  # ordered after s1's copy by the event
    dev.synchronize_stream(s2)
    dev.synchronize_event(event)
    assert dev.query_event(event)
    assert dev.read(ptr + 4 * MiB, 64) == b"x" * 64
    out = ctypes.create_string_buffer(64)
    dev.copy_to_host(ctypes.addressof(out), ptr + 4 * MiB, 64, s1)
    dev.synchronize()
    assert out.raw == b"x" * 64
    if not on_a_real_gpu(dev):
        assert resources(dev)["streams"] == 2 and resources(dev)["events"] == 1
        assert resources(dev)["host_allocations"] == 1
    dev.host_free(host)
    dev.destroy_event(event)
    dev.destroy_stream(s1)
    dev.destroy_stream(s2)
    free_mapped(dev, ptr, handle, 4 * G)


def test_counters_and_modeled_seconds_are_exact(dev):
    dev.reset_counters()
    ptr, handle = mapped(dev)
    with pytest.raises(DeviceError):
        dev.map(ptr, G, handle)  # already mapped: counted all the same
    dev.write(ptr, b"abc")
    assert dev.read(ptr, 3) == b"abc"
    free_mapped(dev, ptr, handle)
    counters = dev.counters()
    expected = {"create": 1, "reserve": 1, "map": 2, "set_access": 1, "unmap": 1,
                "release": 1, "free_address": 1, "copy_to_device": 1, "copy_to_host": 1}
    for name, value in expected.items():
        assert counters[name] == value, name
    assert counters["memory_management_calls"] == 8
    assert counters["bytes_to_device"] == 3 and counters["bytes_to_host"] == 3
    model = dev.cost_model()
    assert counters["modeled_seconds"] == pytest.approx(
        sum(model[name] * value for name, value in expected.items() if name in model),
        rel=1e-9)
    dev.reset_counters()
    assert not any(dev.counters().values())
