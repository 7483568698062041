"""Properties of PageStream over page sizes, budgets, prefetch depths and random access: every
page served holds exactly its bytes, resident pages keep their pointer and are copied once,
gather equals NumPy's fancy indexing, and nothing is left once the stream is closed."""

import os
import tempfile
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc import offload
from vmalloc.offload.pages import PageStream, PrefetchWarning

ROW = 64   # bytes: 16 float32 columns


@st.composite
def scenarios(draw):
    rows = draw(st.lists(st.integers(0, 12), min_size=1, max_size=7).filter(any))
    largest = max(rows) * ROW
    total = sum(rows) * ROW
    budget = draw(st.one_of(st.none(), st.integers(largest, total + largest)))
    prefetch = draw(st.integers(0, 4))
    accesses = draw(st.lists(st.integers(0, len(rows) - 1), max_size=20))
    gather = draw(st.lists(st.integers(0, sum(rows) - 1), max_size=12))
    source = draw(st.sampled_from(["arrays", "callable", "memmap"]))
    return rows, budget, prefetch, accesses, gather, source


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_pages_are_exact_resident_pages_stable_and_nothing_leaks(scenario):
    rows, budget, prefetch, accesses, rows_to_gather, source = scenario
    dev = vmalloc.HostDevice(capacity="8MiB", granularity="4KiB")
    va = vmalloc.VirtualAllocator(dev)
    manager = offload.SwapManager(va)
    rng = np.random.default_rng(len(accesses))
    pages = [rng.standard_normal((r, 16)).astype(np.float32) for r in rows]
    if source == "callable":
        # A callable promises one shape for every page: pad to the largest.
        pages = [np.resize(p, (max(rows), 16)).astype(np.float32) for p in pages]
        args = dict(count=len(pages), dtype="float32", page_shape=(max(rows), 16))
        src = pages.__getitem__
    elif source == "memmap":
        # Views of one file on disk: every copy is a read from disk.
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, "pages.f32")
        np.concatenate(pages).tofile(path)
        whole = np.memmap(path, dtype=np.float32, mode="r", shape=(sum(rows), 16))
        offsets = np.cumsum([0] + rows)
        args, src = {}, [whole[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    else:
        args, src = {}, pages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrefetchWarning)
        stream = PageStream(src, manager=manager, prefetch=prefetch, budget=budget, **args)
    with stream:
        order = list(range(len(pages))) + accesses      # a pass, then random access
        pointers = {}
        for i in order:
            page = stream.page(i)
            np.testing.assert_array_equal(page.to_numpy(), pages[i])
            if page.resident:
                assert pointers.setdefault(i, page.ptr) == page.ptr
        s = stream.stats()
        resident_served = [i for i in order if i in stream.plan.resident]
        assert s["resident_hits"] == len(resident_served) - len(set(resident_served))
        assert s["pages_served"] == len(order)
        used = stream.plan.device_bytes + s["resident_bytes"]
        assert budget is None or used <= budget
        disk = s["bytes_copied"] if source == "memmap" else 0
        assert s["bytes_read_from_disk"] == disk
        if rows_to_gather:
            flat = np.concatenate(pages)
            rows_to_gather = [r % len(flat) for r in rows_to_gather]
            got = stream.gather(rows_to_gather)
            np.testing.assert_array_equal(got.to_numpy(), flat[rows_to_gather])
    s = manager.stats()
    assert (s["host_bytes_in_use"], s["host_blocks_in_use"]) == (0, 0)
    assert va.stats().live_allocations == 0
