"""Bad pages are one clear error naming the page and the problem, and leave nothing behind:
no pinned staging block in use, no device allocation once the stream is closed, and the
stream still serving the good pages."""

import os

import numpy as np
import pytest

import vmalloc
from vmalloc import offload
from vmalloc.offload.pages import PageError, PageStream

KiB = 1024


def make(host_capacity=None):
    dev = vmalloc.HostDevice(capacity="16MiB", granularity="64KiB")
    va = vmalloc.VirtualAllocator(dev)
    return dev, va, offload.SwapManager(va, host_capacity=host_capacity)


def assert_nothing_left(va, manager):
    assert va.device.state()["events"] == 0
    s = manager.stats()
    assert (s["host_bytes_in_use"], s["host_blocks_in_use"]) == (0, 0)
    assert va.stats().live_allocations == 0


@pytest.mark.parametrize("bad, message", [
    (np.zeros((4, 8), np.float64), "page 1 has dtype float64, the stream's is float32"),
    (np.zeros((4, 9), np.float32), r"page 1 has shape \(4, 9\), rows of shape \(8,\)"),
    ([[1.0] * 8], "page 1 is list, not a NumPy array"),
])
def test_a_page_of_the_wrong_dtype_or_shape_is_refused_before_anything_is_allocated(bad, message):
    dev, va, manager = make()
    with pytest.raises(PageError, match=message):
        PageStream([np.zeros((4, 8), np.float32), bad], manager=manager)
    assert_nothing_left(va, manager)


def test_a_callable_page_that_breaks_its_promise_fails_that_page_only():
    dev, va, manager = make()

    def page(i):
        if i == 2:
            return np.zeros((3, 16), np.float32)
        return np.full((4, 16), i, np.float32)

    with PageStream(page, manager=manager, count=4, dtype="float32", page_shape=(4, 16),
                    prefetch=1, budget=2 * 256) as stream:
        assert (stream.page(1).to_numpy() == 1).all()   # prefetches page 2
        with pytest.raises(PageError, match=r"page 2 has shape \(3, 16\), the callable "
                                            r"promised \(4, 16\)"):
            stream.page(2)
        dev.synchronize()
        stream.stats()   # returns the staging blocks of completed copies (page 1's)
        assert manager.stats()["host_bytes_in_use"] == 0
        assert (stream.page(3).to_numpy() == 3).all()
        assert (stream.page(0).to_numpy() == 0).all()
    assert_nothing_left(va, manager)


def test_a_callable_that_raises_fails_with_its_own_error():
    dev, va, manager = make()

    def page(i):
        raise KeyError(f"no page {i}")

    with PageStream(page, manager=manager, count=2, dtype="uint8", page_shape=(64,)) as s:
        with pytest.raises(KeyError, match="no page 0"):
            s.page(0)
    assert_nothing_left(va, manager)


def test_a_file_that_shrinks_is_named_with_the_bytes_it_lacks(tmp_path):
    dev, va, manager = make()
    path = tmp_path / "pages.u8"
    np.arange(4 * 4096, dtype=np.uint8).tofile(path)
    whole = np.memmap(path, dtype=np.uint8, mode="r", shape=(4, 4096))
    pages = [whole[i:i + 1] for i in range(4)]
    with PageStream(pages, manager=manager, prefetch=0, budget=4096) as stream:
        np.testing.assert_array_equal(stream.page(0).to_numpy(), whole[0:1])
        os.truncate(path, 2 * 4096 + 100)
        with pytest.raises(PageError, match=rf"page 3: {path} has 8292 bytes, the page needs "
                                            r"bytes \[12288, 16384\): the file shrank"):
            stream.page(3)
        np.testing.assert_array_equal(stream.page(1).to_numpy(), whole[1:2])
        assert stream.stats()["bytes_read_from_disk"] == 2 * 4096
    assert_nothing_left(va, manager)


def test_staging_beyond_the_managers_host_capacity_is_an_error_that_leaks_nothing():
    dev, va, manager = make(host_capacity="64KiB")
    pages = [np.ones((1, 128 * KiB), np.uint8)]
    with PageStream(pages, manager=manager) as stream:
        with pytest.raises(vmalloc.OutOfMemoryError):
            stream.page(0)
        assert manager.stats()["host_bytes_in_use"] == 0
    assert_nothing_left(va, manager)


def test_a_callable_source_must_say_what_it_makes():
    dev, va, manager = make()
    with pytest.raises(vmalloc.InvalidArgumentError, match="count=, dtype= and page_shape="):
        PageStream(lambda i: None, manager=manager, count=3)
    with pytest.raises(vmalloc.InvalidArgumentError, match="at least one page"):
        PageStream([], manager=manager)
    with pytest.raises(IndexError, match=r"page index 5 out of range\(0, 1\)"):
        with PageStream([np.ones((1, 8))], manager=manager) as stream:
            stream.page(5)
    assert_nothing_left(va, manager)
