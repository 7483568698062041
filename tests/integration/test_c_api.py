"""The C ABI of libvmalloc.so (include/vmalloc/c_api.h), called through ctypes exactly as
PyTorch's CUDAPluggableAllocator and CuPy's CFunctionAllocator call it, over HostDevice."""

import ctypes
import gc
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc

MiB = 1 << 20
SUCCESS, INVALID_ARGUMENT, INVALID_POINTER, OUT_OF_MEMORY, DEVICE, NO_ALLOCATOR = range(6)

STATS_FIELDS = vmalloc.Stats.field_names()


class CStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in STATS_FIELDS]


@pytest.fixture(scope="module")
def lib():
    lib = ctypes.CDLL(vmalloc.library_path())
    vp, sz, ssz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ssize_t, ctypes.c_int
    signatures = {
        "vmalloc_abi_version": (i, []),
        "vmalloc_last_error": (ctypes.c_char_p, []),
        "vmalloc_last_error_code": (i, []),
        "vmalloc_clear_last_error": (None, []),
        "vmalloc_get_current_allocator": (vp, [i]),
        "vmalloc_set_current_allocator": (i, [i, vp]),
        "vmalloc_allocator_release": (None, [vp]),
        "vmalloc_allocate": (vp, [i, sz, vp]),
        "vmalloc_deallocate": (i, [i, vp, sz, vp]),
        "vmalloc_record_stream": (i, [vp, vp]),
        "vmalloc_get_stats": (i, [i, ctypes.POINTER(CStats)]),
        "vmalloc_reset_peak_stats": (i, [i]),
        "vmalloc_release_cached": (i, [i, ctypes.POINTER(sz)]),
        "vmalloc_torch_alloc": (vp, [ssz, i, vp]),
        "vmalloc_torch_free": (None, [vp, ssz, i, vp]),
        "vmalloc_torch_record_stream": (None, [vp, vp]),
        "vmalloc_torch_empty_cache": (None, []),
        "vmalloc_cupy_malloc": (vp, [vp, sz, i]),
        "vmalloc_cupy_free": (None, [vp, vp, i]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def last_error(lib):
    return lib.vmalloc_last_error_code(), lib.vmalloc_last_error().decode()


@pytest.fixture
def device():
    return vmalloc.HostDevice(capacity="32MiB", granularity="2MiB")


@pytest.fixture
def allocator(make_allocator, device, lib):
    """An allocator of each kind, current for device 0 while the test runs."""
    a = make_allocator(device)
    assert vmalloc.set_current_allocator(a, 0) is None
    lib.vmalloc_clear_last_error()
    yield a
    vmalloc.set_current_allocator(None, 0)
    vmalloc.set_current_allocator(None, 1)


def c_stats(lib, device=0):
    out = CStats()
    assert lib.vmalloc_get_stats(device, ctypes.byref(out)) == SUCCESS
    return vmalloc.Stats(**{name: getattr(out, name) for name in STATS_FIELDS})


# ---- the library and the registry ----


def test_library_path_is_the_loaded_library(lib):
    path = vmalloc.library_path()
    assert os.path.isabs(path) and os.path.basename(path) == "libvmalloc.so"
    assert os.path.isfile(path)
    assert lib.vmalloc_abi_version() == 1


def test_python_and_c_see_one_registry(allocator, lib):
    handle = lib.vmalloc_get_current_allocator(0)
    assert handle
    try:
        # a handle from C, set for device 1 through C, is the same allocator in Python
        assert lib.vmalloc_set_current_allocator(1, handle) == SUCCESS
        wrapper = vmalloc.get_current_allocator(1)
        assert wrapper is not None and wrapper is not allocator
        p = lib.vmalloc_allocate(1, 4096, None)
        assert allocator.allocation_size(p) == 4096
        assert wrapper.stats() == allocator.stats()
        assert wrapper.device.name == allocator.device.name
        assert lib.vmalloc_deallocate(1, p, 4096, None) == SUCCESS
        assert lib.vmalloc_set_current_allocator(1, None) == SUCCESS
        assert vmalloc.get_current_allocator(1) is None
    finally:
        lib.vmalloc_allocator_release(handle)
    assert vmalloc.get_current_allocator(0) is allocator


def test_get_current_allocator_of_an_empty_device(lib):
    lib.vmalloc_clear_last_error()
    assert lib.vmalloc_get_current_allocator(7) is None
    code, message = last_error(lib)
    assert code == NO_ALLOCATOR
    assert message == ("vmalloc_get_current_allocator: no current allocator for device 7 (set "
                       "one with vmalloc.set_current_allocator(allocator, device=7))")


def test_set_current_allocator_rejects_bad_arguments(allocator, lib):
    with pytest.raises(vmalloc.InvalidArgumentError, match="device ordinal 1024 is out of range"):
        vmalloc.set_current_allocator(allocator, 1024)
    with pytest.raises(vmalloc.InvalidArgumentError, match="device ordinal -1 is out of range"):
        vmalloc.get_current_allocator(-1)
    with pytest.raises(TypeError, match="must be a vmalloc.Allocator or None, got str"):
        vmalloc.set_current_allocator("virtual", 0)
    with pytest.raises(TypeError, match="device must be an int ordinal, got str"):
        vmalloc.set_current_allocator(allocator, "cuda:0")
    # nothing changed
    assert vmalloc.get_current_allocator(0) is allocator
    assert vmalloc._core.current_allocator.devices_with_current_allocator() == [0]
    assert lib.vmalloc_set_current_allocator(-3, None) == INVALID_ARGUMENT
    assert last_error(lib)[1] == ("vmalloc_set_current_allocator: device ordinal -3 is out of "
                                  "range [0, 1024)")


def test_set_returns_the_previous_allocator(allocator, make_allocator, device):
    other = make_allocator(device)
    assert vmalloc.set_current_allocator(other, 0) is allocator
    assert vmalloc.set_current_allocator(allocator, 0) is other
    assert vmalloc.set_current_allocator(None, 0) is allocator
    assert vmalloc.get_current_allocator(0) is None


# ---- PyTorch's signatures ----


def test_torch_alloc_and_free(allocator, lib, device):
    p = lib.vmalloc_torch_alloc(1000, 0, None)
    assert p and p % 512 == 0
    assert allocator.allocation_size(p) == 1000
    stats = allocator.stats()
    assert (stats.requested_bytes, stats.live_allocations, stats.total_allocations) == (1000, 1, 1)
    assert c_stats(lib) == stats
    # it is real device memory
    device.write(p, b"vmalloc!" * 125)
    assert device.read(p, 1000) == b"vmalloc!" * 125
    lib.vmalloc_torch_free(p, 1000, 0, None)
    stats = allocator.stats()
    assert (stats.requested_bytes, stats.live_allocations, stats.total_deallocations) == (0, 0, 1)
    assert c_stats(lib) == stats
    assert last_error(lib) == (SUCCESS, "")


def test_zero_size_is_null_and_no_error(allocator, lib):
    assert lib.vmalloc_torch_alloc(0, 0, None) is None
    assert lib.vmalloc_cupy_malloc(None, 0, 0) is None
    assert lib.vmalloc_allocate(0, 0, None) is None
    lib.vmalloc_torch_free(None, 0, 0, None)  # freeing null is a no-op
    lib.vmalloc_cupy_free(None, None, 0)
    assert last_error(lib) == (SUCCESS, "")
    assert allocator.stats().total_allocations == 0


def test_unknown_device_is_null_and_names_the_device(allocator, lib):
    assert lib.vmalloc_torch_alloc(4096, 3, None) is None
    assert last_error(lib) == (
        NO_ALLOCATOR, "vmalloc_torch_alloc: no current allocator for device 3 (set one with "
                      "vmalloc.set_current_allocator(allocator, device=3))")
    assert lib.vmalloc_cupy_malloc(None, 4096, 2) is None
    assert last_error(lib)[0] == NO_ALLOCATOR
    assert "device 2" in last_error(lib)[1]
    assert allocator.stats().total_allocations == 0


def test_negative_torch_size_is_rejected(allocator, lib):
    assert lib.vmalloc_torch_alloc(-5, 0, None) is None
    assert last_error(lib) == (INVALID_ARGUMENT, "vmalloc_torch_alloc: size -5 is negative")
    assert allocator.stats().total_allocations == 0


def test_out_of_memory_is_null_with_a_message(allocator, lib):
    before = allocator.stats()
    assert lib.vmalloc_torch_alloc(64 * MiB, 0, None) is None
    code, message = last_error(lib)
    assert code == OUT_OF_MEMORY
    assert message.startswith("vmalloc_torch_alloc: ")
    after = allocator.stats()
    assert after.out_of_memory_count == before.out_of_memory_count + 1
    assert after.live_allocations == 0 and after.requested_bytes == 0
    # the allocator is still usable
    p = lib.vmalloc_torch_alloc(MiB, 0, None)
    assert p
    lib.vmalloc_torch_free(p, MiB, 0, None)
    assert allocator.stats().live_allocations == 0


def test_bad_pointer_free_does_not_crash(allocator, lib):
    p = lib.vmalloc_torch_alloc(4096, 0, None)
    before = allocator.stats()
    lib.vmalloc_torch_free(0xDEAD000, 16, 0, None)
    code, message = last_error(lib)
    assert code == INVALID_POINTER
    assert message.startswith("vmalloc_torch_free: ")
    assert allocator.stats() == before
    lib.vmalloc_torch_free(p, 4096, 0, None)
    assert last_error(lib)[0] == INVALID_POINTER  # sticky until cleared, like errno
    lib.vmalloc_clear_last_error()
    lib.vmalloc_torch_free(p, 4096, 0, None)  # double free
    assert last_error(lib)[0] == INVALID_POINTER
    assert allocator.stats().live_allocations == 0
    assert allocator.stats().total_deallocations == before.total_deallocations + 1


def test_free_with_a_wrong_size_changes_nothing(allocator, lib):
    p = lib.vmalloc_torch_alloc(4096, 0, None)
    lib.vmalloc_torch_free(p, 4000, 0, None)
    assert last_error(lib)[0] == INVALID_ARGUMENT
    assert allocator.allocation_size(p) == 4096
    lib.vmalloc_clear_last_error()
    lib.vmalloc_torch_free(p, 4096, 0, None)
    assert last_error(lib) == (SUCCESS, "")
    assert allocator.stats().live_allocations == 0


def test_errors_are_thread_local(allocator, lib):
    seen = {}

    def fail_here():
        lib.vmalloc_clear_last_error()
        assert lib.vmalloc_torch_alloc(16, 9, None) is None
        seen["thread"] = last_error(lib)

    lib.vmalloc_clear_last_error()
    thread = threading.Thread(target=fail_here)
    thread.start()
    thread.join()
    assert seen["thread"][0] == NO_ALLOCATOR and "device 9" in seen["thread"][1]
    assert last_error(lib) == (SUCCESS, "")
    assert lib.vmalloc_torch_alloc(-1, 0, None) is None
    assert last_error(lib)[0] == INVALID_ARGUMENT
    assert vmalloc._core.current_allocator.last_error() == (
        INVALID_ARGUMENT, "vmalloc_torch_alloc: size -1 is negative")
    vmalloc._core.current_allocator.clear_last_error()
    assert last_error(lib) == (SUCCESS, "")


# ---- CuPy's signatures ----


def test_cupy_malloc_and_free_carry_the_stream(allocator, lib, device):
    stream = device.create_stream()
    try:
        p = lib.vmalloc_cupy_malloc(stream, 3 * MiB, 0)
        assert allocator.allocation_size(p) == 3 * MiB
        assert c_stats(lib).requested_bytes == 3 * MiB
        lib.vmalloc_cupy_free(stream, p, 0)  # CuPy frees without a size
        assert last_error(lib) == (SUCCESS, "")
        assert allocator.stats().live_allocations == 0
        lib.vmalloc_cupy_free(stream, p, 0)
        assert last_error(lib)[0] == INVALID_POINTER
    finally:
        device.synchronize()
        device.destroy_stream(stream)


# ---- ownership, streams, statistics ----


def test_free_reaches_the_allocator_that_made_it(allocator, make_allocator, device, lib):
    p = lib.vmalloc_torch_alloc(8192, 0, None)
    other = make_allocator(device)
    vmalloc.set_current_allocator(other, 0)
    del allocator  # the ABI keeps the first allocator alive while its allocation is live
    gc.collect()
    lib.vmalloc_torch_free(p, 8192, 0, None)
    assert last_error(lib) == (SUCCESS, "")
    assert other.stats().total_allocations == 0 and other.stats().total_deallocations == 0


def test_memory_freed_behind_the_abi_is_still_freed_correctly(allocator, lib):
    # allocated through the ABI, freed through Python, then the address comes back
    p = lib.vmalloc_torch_alloc(4096, 0, None)
    allocator.deallocate(p, 4096)
    q = lib.vmalloc_torch_alloc(4096, 0, None)
    lib.vmalloc_torch_free(q, 4096, 0, None)
    assert last_error(lib) == (SUCCESS, "")
    # allocated through Python, freed through the ABI: the current allocator takes it
    r = allocator.allocate(4096)
    assert lib.vmalloc_deallocate(0, r, 4096, None) == SUCCESS
    assert allocator.stats().live_allocations == 0


def test_record_stream_makes_the_free_wait_for_the_other_stream(allocator, lib, device):
    s1, s2 = device.create_stream(), device.create_stream()
    try:
        def free_delta(record):
            p = lib.vmalloc_torch_alloc(4096, 0, s1)
            if record:
                lib.vmalloc_torch_record_stream(p, s2)
                lib.vmalloc_torch_record_stream(p, s2)  # once is enough
                lib.vmalloc_torch_record_stream(p, s1)  # its own stream adds nothing
            before = device.counters()
            lib.vmalloc_torch_free(p, 4096, 0, s1)
            after = device.counters()
            assert last_error(lib) == (SUCCESS, "")
            return {k: after[k] - before[k] for k in
                    ("event_create", "event_record", "stream_wait_event", "event_destroy")}

        plain, recorded = free_delta(False), free_delta(True)
        assert {k: recorded[k] - plain[k] for k in plain} == {
            "event_create": 1, "event_record": 1, "stream_wait_event": 1, "event_destroy": 1}
        lib.vmalloc_torch_record_stream(0xBAD000, s2)
        code, message = last_error(lib)
        assert code == INVALID_POINTER
        assert message == ("vmalloc_torch_record_stream: pointer 0xbad000 is not a live "
                           "allocation made through the vmalloc C ABI")
        assert lib.vmalloc_record_stream(0xBAD000, s2) == INVALID_POINTER
    finally:
        device.synchronize()
        device.destroy_stream(s1)
        device.destroy_stream(s2)


def test_release_cached_and_peaks_through_the_abi(allocator, lib):
    p = lib.vmalloc_torch_alloc(5 * MiB, 0, None)
    lib.vmalloc_torch_free(p, 5 * MiB, 0, None)
    held = allocator.stats()
    assert held.peak_requested_bytes == 5 * MiB and held.cached_bytes == held.reserved_bytes > 0
    assert lib.vmalloc_reset_peak_stats(0) == SUCCESS
    assert c_stats(lib).peak_requested_bytes == 0
    released = ctypes.c_size_t(0)
    assert lib.vmalloc_release_cached(0, ctypes.byref(released)) == SUCCESS
    assert released.value == held.cached_bytes
    assert allocator.stats().reserved_bytes == 0
    # PyTorch's empty_cache hook releases every device's cache
    p = lib.vmalloc_torch_alloc(MiB, 0, None)
    lib.vmalloc_torch_free(p, MiB, 0, None)
    assert allocator.stats().reserved_bytes > 0
    lib.vmalloc_torch_empty_cache()
    assert allocator.stats().reserved_bytes == 0
    assert lib.vmalloc_get_stats(0, None) == INVALID_ARGUMENT
    assert lib.vmalloc_get_stats(4, ctypes.byref(CStats())) == NO_ALLOCATOR
    assert lib.vmalloc_release_cached(4, None) == NO_ALLOCATOR
    assert lib.vmalloc_reset_peak_stats(4) == NO_ALLOCATOR


def test_two_devices_are_routed_separately(allocator, make_allocator, lib):
    second = make_allocator(vmalloc.HostDevice(capacity="32MiB", ordinal=1))
    vmalloc.set_current_allocator(second, 1)
    p0 = lib.vmalloc_torch_alloc(1024, 0, None)
    p1 = lib.vmalloc_torch_alloc(2048, 1, None)
    assert allocator.allocation_size(p0) == 1024 and second.allocation_size(p1) == 2048
    assert c_stats(lib, 0).requested_bytes == 1024 and c_stats(lib, 1).requested_bytes == 2048
    lib.vmalloc_torch_free(p0, 1024, 0, None)
    lib.vmalloc_torch_free(p1, 2048, 1, None)
    assert last_error(lib) == (SUCCESS, "")


def test_a_cuda_allocator_is_not_set_for_another_ordinal(make_allocator):
    if not hasattr(vmalloc, "CudaDevice"):
        pytest.skip("vmalloc.CudaDevice is not built")
    testing = pytest.importorskip("vmalloc.testing")
    if not hasattr(testing, "emulated_cuda_device"):
        pytest.skip("vmalloc.testing.emulated_cuda_device is not built")
    a = make_allocator(testing.emulated_cuda_device(capacity="64MiB"))
    with pytest.raises(vmalloc.InvalidArgumentError, match="runs on cuda:0 but is being set "
                                                           "for device 1"):
        vmalloc.set_current_allocator(a, 1)
    assert vmalloc.get_current_allocator(1) is None


def test_abi_over_the_emulated_cuda_device(make_allocator, lib):
    if not hasattr(vmalloc, "CudaDevice"):
        pytest.skip("vmalloc.CudaDevice is not built")
    testing = pytest.importorskip("vmalloc.testing")
    if not hasattr(testing, "emulated_cuda_device"):
        pytest.skip("vmalloc.testing.emulated_cuda_device is not built")
    device = testing.emulated_cuda_device(capacity="64MiB")
    a = make_allocator(device)
    vmalloc.set_current_allocator(a, 0)
    try:
        stream = device.create_stream()
        p = lib.vmalloc_torch_alloc(3 * MiB, 0, stream)
        assert a.allocation_size(p) == 3 * MiB
        device.write(p, b"through libcuda", stream=stream)
        assert device.read(p, 15, stream=stream) == b"through libcuda"
        lib.vmalloc_torch_free(p, 3 * MiB, 0, stream)
        assert c_stats(lib).live_allocations == 0
        device.synchronize()
        device.destroy_stream(stream)
    finally:
        vmalloc.set_current_allocator(None, 0)


def test_concurrent_threads(allocator, lib):
    errors = []

    def worker(seed):
        try:
            live = []
            for i in range(200):
                size = 512 * (1 + (seed * 7 + i * 13) % 64)
                p = lib.vmalloc_torch_alloc(size, 0, None)
                assert p, last_error(lib)
                live.append((p, size))
                if i % 3 == 2:
                    q, n = live.pop(0)
                    lib.vmalloc_torch_free(q, n, 0, None)
            for q, n in live:
                lib.vmalloc_torch_free(q, n, 0, None)
            assert last_error(lib) == (SUCCESS, "")
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = allocator.stats()
    assert (stats.live_allocations, stats.total_allocations, stats.total_deallocations) == (
        0, 800, 800)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3 * MiB)), min_size=1, max_size=40))
def test_abi_accounting_matches_the_allocator(make_allocator, lib, ops):
    a = make_allocator(vmalloc.HostDevice(capacity="64MiB", granularity="2MiB"))
    vmalloc.set_current_allocator(a, 0)
    try:
        live = {}
        for allocate, size in ops:
            if allocate or not live:
                p = lib.vmalloc_torch_alloc(size, 0, None)
                if p is None:
                    assert last_error(lib)[0] == OUT_OF_MEMORY
                    continue
                assert p not in live
                live[p] = size
            else:
                p, n = live.popitem()
                lib.vmalloc_torch_free(p, n, 0, None)
            stats = c_stats(lib)
            assert stats == a.stats()
            assert stats.requested_bytes == sum(live.values())
            assert stats.live_allocations == len(live)
        for p, n in live.items():
            assert a.allocation_size(p) == n
            lib.vmalloc_torch_free(p, n, 0, None)
        assert c_stats(lib).live_allocations == 0
    finally:
        vmalloc.set_current_allocator(None, 0)
