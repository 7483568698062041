"""vmalloc as an RMM memory resource: the callback layer (RMM's CallbackMemoryResource
signatures) on the emulated device without RMM, and the resource itself where RMM imports
(it needs CUDA)."""

import threading
import warnings

import pytest

import vmalloc
from vmalloc.frameworks.rmm import RmmCallbacks, memory_resource, stream_handle

MiB = 1 << 20


def make():
    dev = vmalloc.HostDevice(capacity="32MiB")
    return dev, vmalloc.VirtualAllocator(dev)


def test_allocate_and_deallocate_have_rmms_signatures_and_move_real_memory():
    dev, va = make()
    cb = RmmCallbacks(va)
    a = cb.allocate(3 * MiB, 0)           # allocate_func(size, stream)
    b = cb.allocate(100)                  # older RMM: allocate_func(size)
    dev.write(a, b"x" * 16)
    assert dev.read(a, 16) == b"x" * 16
    assert va.stats().live_allocations == 2
    assert cb.stats() == dict(allocations=2, deallocations=0, bytes_allocated=3 * MiB + 100,
                              bytes_in_use=3 * MiB + 100, peak_bytes_in_use=3 * MiB + 100,
                              failed_allocations=0, unknown_streams=0, live=2)
    cb.deallocate(a, 3 * MiB, 0)          # deallocate_func(ptr, size, stream)
    cb.deallocate(b, 100)
    assert va.stats().live_allocations == 0
    assert cb.stats()["bytes_in_use"] == 0 and cb.stats()["peak_bytes_in_use"] == 3 * MiB + 100


def test_a_zero_byte_request_is_address_zero_and_allocates_nothing():
    dev, va = make()
    cb = RmmCallbacks(va)
    assert cb.allocate(0, 0) == 0
    cb.deallocate(0, 0, 0)
    assert va.stats().live_allocations == 0 and cb.stats()["allocations"] == 0


def test_a_wrong_free_is_refused_and_frees_nothing():
    dev, va = make()
    cb = RmmCallbacks(va)
    p = cb.allocate(MiB, 0)
    with pytest.raises(vmalloc.InvalidArgumentError, match=f"{p:#x} has 1048576 bytes, RMM "
                                                           "passed size 10"):
        cb.deallocate(p, 10, 0)
    with pytest.raises(vmalloc.InvalidPointerError, match="not allocated by these RMM"):
        cb.deallocate(p + 4096, MiB, 0)
    assert va.stats().live_allocations == 1
    cb.deallocate(p, MiB, 0)
    with pytest.raises(vmalloc.InvalidPointerError, match="or was freed"):
        cb.deallocate(p, MiB, 0)
    assert va.stats().live_allocations == 0


def test_out_of_memory_is_vmallocs_error_and_counted():
    dev, va = make()
    cb = RmmCallbacks(va)
    with pytest.raises(vmalloc.OutOfMemoryError):
        cb.allocate(64 * MiB, 0)
    assert cb.stats()["failed_allocations"] == 1 and cb.stats()["live"] == 0
    with pytest.raises(vmalloc.InvalidArgumentError, match="non-negative int"):
        cb.allocate(-1, 0)


class ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0)


class Opaque:
    pass


def test_streams_in_the_forms_rmm_and_cuda_python_pass():
    assert stream_handle(None) == 0 and stream_handle(7) == 7
    assert stream_handle(ProtocolStream()) == 0
    assert stream_handle(type("S", (), {"value": lambda self: 5})()) == 5
    assert stream_handle(Opaque()) is None
    dev, va = make()
    cb = RmmCallbacks(va)
    with pytest.warns(RuntimeWarning, match="cannot read the stream of Opaque"):
        p = cb.allocate(MiB, Opaque())
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # said once
        cb.deallocate(p, MiB, Opaque())
    assert cb.stats()["unknown_streams"] == 2


def test_threads_allocating_and_freeing_leave_exact_books():
    dev, va = make()
    cb = RmmCallbacks(va)

    def work(k):
        for n in range(50):
            size = 4096 * (1 + (n + k) % 7)
            cb.deallocate(cb.allocate(size, 0), size, 0)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cb.stats()
    assert (s["allocations"], s["deallocations"], s["bytes_in_use"], s["live"]) == (200, 200, 0, 0)
    assert va.stats().live_allocations == 0


def _rmm_or_skip():
    try:
        import rmm
    except Exception as error:  # no RMM, or RMM without CUDA
        pytest.skip(f"RMM cannot import here ({type(error).__name__}: {error}); the callback "
                    "layer is tested above on the emulated device")
    return rmm


def test_without_rmm_the_resource_says_what_it_needs():
    try:
        import rmm  # noqa: F401
        pytest.skip("RMM imports here: the resource is tested below")
    except Exception:
        pass
    dev, va = make()
    with pytest.raises(ImportError, match="needs RMM with CUDA"):
        memory_resource(va)


def test_rmm_allocates_through_vmalloc():
    rmm = _rmm_or_skip()
    dev = vmalloc.CudaDevice(0)
    va = vmalloc.VirtualAllocator(dev)
    cb = RmmCallbacks(va)
    resource = memory_resource(va, cb)
    buffer = rmm.DeviceBuffer(size=4 * MiB, mr=resource)
    assert cb.stats()["live"] == 1 and va.stats().live_allocations == 1
    del buffer
    assert cb.stats()["live"] == 0 and va.stats().live_allocations == 0
