"""The page-stream scan model (vmalloc.offload.pages.model): the copy/use recurrence against
its closed forms, and exact predictions for the simulator's GPUs."""

import pytest
from hypothesis import given, settings, strategies as st

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.hardware.gpus import GPUS
from vmalloc.offload.pages.model import predict_scan, scan_seconds

MiB = 2**20


def test_a_link_bound_scan_waits_for_every_copy_but_the_overlap():
    # copy 3 s, use 1 s, 4 pages, one ahead: copies back to back, the consumer waits
    # 3 s for the first and 2 s for each later page.
    assert scan_seconds(4, 3.0, 1.0, 1) == (13.0, 9.0)


def test_a_consumer_bound_scan_waits_only_for_the_first_page():
    assert scan_seconds(4, 1.0, 3.0, 1) == (13.0, 1.0)


def test_without_prefetch_copy_and_use_alternate():
    assert scan_seconds(4, 3.0, 1.0, 0) == (16.0, 12.0)
    assert scan_seconds(0, 3.0, 1.0, 2) == (0.0, 0.0)


@settings(max_examples=60, deadline=None)
@given(pages=st.integers(1, 40), copy=st.integers(0, 50), use=st.integers(0, 50),
       prefetch=st.integers(0, 6))
def test_the_recurrence_meets_the_closed_forms(pages, copy, use, prefetch):
    seconds, wait = scan_seconds(pages, float(copy), float(use), prefetch)
    if prefetch >= 1:
        assert seconds == copy + (pages - 1) * max(copy, use) + use
        assert wait == copy + (pages - 1) * max(0, copy - use)
    else:
        assert (seconds, wait) == (pages * (copy + use), pages * copy)


def test_v100_scan_of_32_mib_pages_exactly():
    p = predict_scan("v100-16gb", 32 * MiB, 100, prefetch=1)
    copy = 32 * MiB / 45.9e9        # NVLink 2, 2 bricks
    use = 32 * MiB / 900e9          # one read of the page at HBM2 bandwidth
    assert (p.copy_seconds, p.use_seconds) == (copy, use)
    assert p.seconds == pytest.approx(copy + 99 * copy + use, rel=1e-12)
    assert p.wait_seconds == pytest.approx(copy + 99 * (copy - use), rel=1e-12)
    assert p.pages_per_second == pytest.approx(100 / (100 * copy + use), rel=1e-12)
    assert round(p.bytes_per_second / 1e9, 2) == 45.88
    # (100 copy - 99 use) / (100 copy + use): the link, not the kernel, sets the pace
    assert round(p.wait_fraction, 4) == 0.9490


def test_auto_prefetch_on_each_gpu_and_a_slow_consumer():
    # 4 MiB pages: a millisecond of the link is 11 (v100), 6 (a100), 14 (h100) pages -> 8 max.
    assert {n: predict_scan(n, 4 * MiB, 10).prefetch for n in
            ("v100-16gb", "a100-40gb", "h100-80gb")} == {
        "v100-16gb": 8, "a100-40gb": 6, "h100-80gb": 8}
    # A consumer slower than the copy: nothing waits after the first page.
    p = predict_scan("h100-80gb", 4 * MiB, 10, prefetch=2, use_seconds=1e-3)
    assert p.wait_seconds == pytest.approx(4 * MiB / 55.3e9, rel=1e-12)
    assert p.seconds == pytest.approx(4 * MiB / 55.3e9 + 10e-3, rel=1e-12)


def test_every_gpu_model_predicts_a_scan():
    for name in GPUS:
        p = predict_scan(name, 8 * MiB, 16, prefetch=2)
        assert p.bytes_per_second <= GPUS[name].h2d_bandwidth * (1 + 1e-12)


def test_bad_arguments_are_named():
    with pytest.raises(InvalidArgumentError, match="page_bytes"):
        predict_scan("v100-16gb", 0, 3)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        scan_seconds(3, -1.0, 1.0, 1)
    with pytest.raises(InvalidArgumentError, match="unknown GPU"):
        predict_scan("v200", MiB, 3)
