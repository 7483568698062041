"""vmalloc.offload.PageStream on the emulated device: bytes exact, the resident cache, the
prefetch plan, memmap files, callables, gather, and the counts of stats()."""

import ctypes

import numpy as np
import pytest

import vmalloc
from vmalloc import offload
from vmalloc.offload.pages import PageError, PageStream, PrefetchWarning, auto_prefetch

KiB = 1024


def make(granularity="64KiB"):
    dev = vmalloc.HostDevice(capacity="64MiB", granularity=granularity)
    va = vmalloc.VirtualAllocator(dev)
    return dev, va, offload.SwapManager(va)


def pages_of(rows, cols=1024, seed=0):
    """float32 pages of `cols` columns (4 KiB a row)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((r, cols)).astype(np.float32) for r in rows]


def assert_nothing_left(dev, va, manager, events=0):
    s = manager.stats()
    assert (s["host_bytes_in_use"], s["host_blocks_in_use"]) == (0, 0)
    assert va.stats().live_allocations == 0
    if events is not None:
        assert dev.state()["events"] == events   # every copy and slot event destroyed
    manager.release_cached_host()
    assert dev.state()["host_allocations"] == 0


def test_every_page_fits_so_all_stay_resident_and_a_second_pass_copies_nothing():
    dev, va, manager = make()
    pages = pages_of([16, 16, 8])
    with PageStream(pages, manager=manager, prefetch=1) as stream:
        first = [(p.ptr, p.to_numpy()) for p in stream]
        second = [p.ptr for p in stream]
        s = stream.stats()
    for (ptr, got), want, again in zip(first, pages, second):
        np.testing.assert_array_equal(got, want)
        assert ptr == again   # pointer-stable across passes
    assert (s["pages_served"], s["pages_copied"], s["resident_hits"]) == (6, 3, 3)
    assert s["bytes_copied"] == (16 + 16 + 8) * 4 * KiB
    assert (s["slots"], s["resident_pages"], s["bytes_read_from_disk"]) == (0, 3, 0)
    assert_nothing_left(dev, va, manager)


def test_a_budget_keeps_the_first_pages_resident_and_streams_the_rest_through_slots():
    dev, va, manager = make()
    pages = pages_of([16] * 6)          # 64 KiB each
    with PageStream(pages, manager=manager, prefetch=1, budget=4 * 64 * KiB) as stream:
        assert (stream.plan.slots, sorted(stream.plan.resident)) == (2, [0, 1])
        for _ in range(3):
            for page, want in zip(stream, pages):
                np.testing.assert_array_equal(page.to_numpy(), want)
        s = stream.stats()
    # Pass 1 copies all six; passes 2 and 3 copy the four streamed pages each.
    assert (s["pages_served"], s["pages_copied"], s["resident_hits"]) == (18, 14, 4)
    assert s["bytes_copied"] == 14 * 64 * KiB
    assert s["evicted_prefetches"] == 0
    assert_nothing_left(dev, va, manager)


def test_memmap_pages_and_views_of_one_file_are_read_from_disk(tmp_path):
    dev, va, manager = make()
    data = pages_of([40])[0]
    path = tmp_path / "data.f32"
    data.tofile(path)
    whole = np.memmap(path, dtype=np.float32, mode="r", shape=data.shape)
    views = [whole[0:16], whole[16:32], whole[32:40]]
    other = np.memmap(path, dtype=np.float32, mode="r", offset=16 * 4 * KiB, shape=(8, 1024))
    with PageStream(views + [other], manager=manager, prefetch=2, budget=3 * 64 * KiB,
                    workers=3) as stream:
        got = [p.to_numpy() for p in stream]
        s = stream.stats()
    for g, want in zip(got, [data[0:16], data[16:32], data[32:40], data[16:24]]):
        np.testing.assert_array_equal(g, want)
    assert s["bytes_read_from_disk"] == (16 + 16 + 8 + 8) * 4 * KiB
    assert_nothing_left(dev, va, manager)


def test_a_copy_on_write_memmap_page_is_copied_from_memory_with_its_writes(tmp_path):
    dev, va, manager = make()
    path = tmp_path / "cow.f32"
    np.zeros((4, 1024), np.float32).tofile(path)
    page = np.memmap(path, dtype=np.float32, mode="c", shape=(4, 1024))
    page[1, 2] = 7.0      # private to this mapping: the file still holds zeros
    with PageStream([page], manager=manager) as stream:
        assert stream.page(0).to_numpy()[1, 2] == 7.0
        assert stream.stats()["bytes_read_from_disk"] == 0
    assert_nothing_left(dev, va, manager)


def test_a_callable_makes_each_page_when_it_is_read_and_the_prefetch_wraps_around():
    dev, va, manager = make()
    made = []

    def page(i):
        made.append(i)
        return np.full((8, 256), i, dtype=np.int64)

    with PageStream(page, manager=manager, count=5, dtype=np.int64, page_shape=(8, 256),
                    prefetch=1, budget=2 * 16 * KiB) as stream:
        for p in stream:
            assert (p.to_numpy() == p.index).all()
        assert stream.stats()["resident_pages"] == 0
    # After page 4 the prefetch reads page 0 again, for the next pass (dropped at close).
    assert sorted(made) == [0, 0, 1, 2, 3, 4]   # (worker threads: any order)
    assert_nothing_left(dev, va, manager)


def test_random_access_evicts_a_prefetched_page_and_says_so():
    dev, va, manager = make()
    pages = pages_of([4] * 8, cols=256)   # 4 KiB each
    with PageStream(pages, manager=manager, prefetch=2, budget=3 * 4 * KiB) as stream:
        stream.page(0)                    # prefetches 1 and 2: every slot busy
        np.testing.assert_array_equal(stream.page(6).to_numpy(), pages[6])
        np.testing.assert_array_equal(stream.page(1).to_numpy(), pages[1])
        s = stream.stats()
    # The prefetch follows the latest access: 1 and 2 dropped for 7 and 0 (after 6), then
    # those for 2 and 3 (after 1).
    assert s["evicted_prefetches"] == 4
    assert_nothing_left(dev, va, manager)


def test_gather_compacts_rows_of_every_page_in_the_order_given():
    dev, va, manager = make()
    pages = pages_of([5, 7, 3, 9], cols=64)
    rows = [20, 0, 1, 2, 11, 12, 13, 4, 23, 5, 14]
    with PageStream(pages, manager=manager, prefetch=1, budget=2 * 9 * 256) as stream:
        out = stream.gather(rows)
        np.testing.assert_array_equal(out.to_numpy(), np.concatenate(pages)[rows])
        assert out.shape == (11, 64) and stream.stats()["rows_gathered"] == 11
        out.free()
        out.free()   # idempotent
        kept = stream.gather(np.array([3, 3, 0]))
        np.testing.assert_array_equal(kept.to_numpy(), np.concatenate(pages)[[3, 3, 0]])
        with pytest.raises(vmalloc.InvalidArgumentError, match="row 24 out of range"):
            stream.gather([1, 24])
        with pytest.raises(vmalloc.InvalidArgumentError, match="no rows"):
            stream.gather([])
    assert_nothing_left(dev, va, manager)   # close freed `kept`


def test_a_budget_below_the_prefetch_lowers_it_once_or_raises_under_strict():
    dev, va, manager = make()
    pages = pages_of([16] * 4)
    with pytest.warns(PrefetchWarning, match="prefetch lowered from 3 to 1"):
        stream = PageStream(pages, manager=manager, prefetch=3, budget=2 * 64 * KiB)
    assert (stream.stats()["prefetch"], stream.stats()["asked_prefetch"]) == (1, 3)
    stream.close()
    with pytest.raises(vmalloc.OutOfMemoryError, match="prefetch lowered"):
        PageStream(pages, manager=manager, prefetch=3, budget=2 * 64 * KiB, strict=True)
    with pytest.raises(vmalloc.OutOfMemoryError, match="smaller than the largest page"):
        PageStream(pages, manager=manager, budget=64 * KiB - 1)
    assert_nothing_left(dev, va, manager)


def test_auto_prefetch_is_the_links_bytes_in_flight_over_the_page_size():
    assert auto_prefetch(1 << 20, 12e9) == 8       # 12 MB in a millisecond: capped
    assert auto_prefetch(4 << 20, 12e9) == 3       # ceil(12e6 / 4 MiB)
    assert auto_prefetch(64 << 20, 12e9) == 1
    assert auto_prefetch(1 << 20, 0) == 2          # no link figure: the default


def test_the_stream_is_exported_and_its_allocator_form_owns_a_manager():
    assert offload.PageStream is PageStream and offload.PageError is PageError
    dev = vmalloc.HostDevice(capacity="8MiB", granularity="64KiB")
    va = vmalloc.VirtualAllocator(dev)
    pages = pages_of([2, 2], cols=16)
    with PageStream(pages, va) as stream:
        assert [p.to_numpy().tolist() for p in stream] == [p.tolist() for p in pages]
        assert repr(stream).startswith("<PageStream 2 pages, 2 resident")
    assert va.stats().live_allocations == 0
    with pytest.raises(vmalloc.InvalidArgumentError, match="closed"):
        stream.page(0)
    with pytest.raises(vmalloc.InvalidArgumentError, match="an allocator or a manager"):
        PageStream(pages)


def test_a_slot_is_refilled_only_after_the_consumers_work_on_its_last_page():
    # A held consumer stream is a kernel still reading page 0 when page 1 is asked for: the
    # copy of page 1 into the same slot must wait for it (on the device).
    dev, va, manager = make()
    consumer = dev.create_stream()
    pages = pages_of([4, 4], cols=256)             # 4 KiB each, one slot
    out = dev.host_alloc(4 * KiB)
    with PageStream(pages, manager=manager, prefetch=0, budget=4 * KiB,
                    stream=consumer) as stream:
        first = stream.page(0)
        hold = dev.hold_stream(consumer)
        dev.copy_to_host(out, first.ptr, 4 * KiB, stream=consumer)   # the "kernel"
        second = stream.page(1)
        assert second.ptr == first.ptr
        dev.release_hold(hold)
        dev.synchronize()
        assert ctypes.string_at(out, 4 * KiB) == pages[0].tobytes()
        np.testing.assert_array_equal(second.to_numpy(), pages[1])
    dev.host_free(out)
    # Events not counted here: the allocator keeps its own for frees on a non-default stream.
    assert_nothing_left(dev, va, manager, events=None)


def test_the_consumers_stream_waits_for_the_copy_on_the_device():
    # The manager's copy stream held: page() returns at once (the read is done, the copy is
    # queued), and work queued on the consumer's stream still sees the page's bytes.
    dev, va, manager = make()
    consumer = dev.create_stream()
    pages = pages_of([4], cols=256)
    out = dev.host_alloc(4 * KiB)
    with PageStream(pages, manager=manager, stream=consumer) as stream:
        hold = dev.hold_stream(manager.streams[1])
        page = stream.page(0)
        dev.copy_to_host(out, page.ptr, 4 * KiB, stream=consumer)
        dev.release_hold(hold)
        dev.synchronize()
        assert ctypes.string_at(out, 4 * KiB) == pages[0].tobytes()
    dev.host_free(out)
    # Events not counted here: the allocator keeps its own for frees on a non-default stream.
    assert_nothing_left(dev, va, manager, events=None)


def test_on_the_strict_driver_emulator_no_call_is_a_misuse():
    # The driver emulator checks every CUDA call (pinned sources of async copies, event and
    # stream lifetimes) and reports misuse.
    from vmalloc import testing
    dev = testing.emulated_cuda_device(capacity="64MiB", granularity="2MiB")
    va = vmalloc.VirtualAllocator(dev)
    manager = offload.SwapManager(va)
    pages = pages_of([16] * 6)
    with PageStream(pages, manager=manager, prefetch=2, budget=4 * 64 * KiB) as stream:
        for _ in range(2):
            for page in stream:
                np.testing.assert_array_equal(page.to_numpy(), pages[page.index])
        for i in (0, 4, 2, 5):
            np.testing.assert_array_equal(stream.page(i).to_numpy(), pages[i])
        got = stream.gather([1, 40, 90])
        np.testing.assert_array_equal(got.to_numpy(), np.concatenate(pages)[[1, 40, 90]])
    s = manager.stats()
    assert (s["host_bytes_in_use"], va.stats().live_allocations) == (0, 0)
    report = testing.emulator().leak_report(dev.ordinal)
    assert [line for line in report.splitlines() if "misuse" in line] == [], report


def test_threads_sharing_a_stream_are_served_exact_pages():
    import threading
    dev, va, manager = make()
    pages = pages_of([4] * 5, cols=256)
    errors = []
    with PageStream(pages, manager=manager, prefetch=2) as stream:   # all resident

        def work(k):
            try:
                for n in range(40):
                    i = (n * (k + 1)) % 5
                    np.testing.assert_array_equal(stream.page(i).to_numpy(), pages[i])
                    stream.stats()
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = stream.stats()
    assert errors == []
    assert (s["pages_served"], s["pages_copied"], s["resident_hits"]) == (120, 5, 115)
    assert_nothing_left(dev, va, manager)
