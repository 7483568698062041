"""The seed's table as a model (vmalloc.offload.pages.xgboost_memory): exact byte counts of
the ELLPACK layout and the largest row counts on a 16 GiB V100, pinned."""

import pytest

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.pages import xgboost_memory as xm

GiB = 2**30


def test_the_seed_layout_packs_17_bit_symbols():
    layout = xm.Layout()            # 500 columns x 256 bins
    assert (layout.total_bins, layout.symbol_bits) == (128_000, 17)   # ceil(log2(128001))
    # 9e6 rows x 500 symbols x 17 bits = 9,562,500,000 bytes, + 4 of padding (already 4-aligned)
    assert layout.ellpack_bytes(9_000_000) == 9_562_500_004
    assert layout.ellpack_bytes(1) == 1064 + 4   # 1062.5 -> 1063 bytes, + 4, rounded up to 4
    assert xm.Layout(columns=1, bins=255).symbol_bits == 8     # 256 symbols: one byte each
    assert xm.Layout(columns=1, bins=256).symbol_bits == 9     # the null bin needs a ninth bit
    # In core, entries copied to the device 1/16 of its memory at a time: 268,435 rows.
    assert layout.build_batch_bytes(16 * GiB) == 268_435 * 500 * 8 == 1_073_740_000


def test_device_bytes_add_up_component_by_component():
    ell = xm.Layout().ellpack_bytes
    n = 1_000_000
    hist = 512 * 2**20
    page = 32 * 2**20
    assert xm.HISTOGRAM_CACHE_BYTES == hist
    assert xm.ROW_STATE_BYTES == 20     # gradient pair 8, two prediction caches, label
    # In core at 1 M rows the 1 GiB build batch outweighs the updater's buffers (20 B a row
    # and the histograms): the build phase is the peak, beside gradients, cache and labels.
    assert xm.device_bytes("in_core", n) == ell(n) + 16 * n + 1_073_740_000
    # At 40 M rows the training phase is the larger one.
    m = 40_000_000
    assert 20 * m + hist > 1_073_740_000
    assert xm.device_bytes("in_core", m) == ell(m) + 36 * m + hist
    assert xm.device_bytes("streamed", n) == ell(n) + 36 * n + page + hist
    # f = 0.1: the compacted page of 100,000 rows; per row of the data set 20 B of state, 16 of
    # sampler buffers and 16 of row partitioner (re-made for every row after the tree); 8 B of
    # compacted gradient pair per sampled row.
    assert xm.device_bytes("sampled", n) == (ell(100_000) + 52 * n + 8 * 100_000 + page + hist)
    assert xm.device_bytes("page_stream", n, prefetch=3) == 36 * n + 4 * page + hist


def test_largest_rows_on_a_16_gib_v100_against_the_seed():
    table = {r["mode"]: r for r in xm.seed_table()}
    assert {m: r["model"] for m, r in table.items()} == {
        "in_core": 14_933_823, "streamed": 15_120_112, "sampled": 104_429_070,
        "page_stream": 460_441_372}
    assert {m: r["seed"] for m, r in table.items()} == {
        "in_core": 9_000_000, "streamed": 13_000_000, "sampled": 85_000_000,
        "page_stream": None}
    # Signed errors (model / seed - 1): the model over-estimates every row of the table.
    assert table["in_core"]["error"] == pytest.approx(14_933_823 / 9e6 - 1)
    assert round(table["in_core"]["error"], 4) == 0.6593
    assert round(table["streamed"]["error"], 4) == 0.1631
    assert round(table["sampled"]["error"], 4) == 0.2286
    assert [round(table[m]["missing_per_row"], 1) for m in ("in_core", "streamed", "sampled")] \
        == [711.1, 179.1, 36.4]
    assert table["page_stream"]["error"] is None


@pytest.mark.parametrize("mode", ["in_core", "streamed", "sampled", "page_stream"])
def test_the_largest_row_count_is_the_last_that_fits(mode):
    rows = xm.largest_rows(mode)
    assert xm.device_bytes(mode, rows) <= xm.V100_BYTES < xm.device_bytes(mode, rows + 1)


def test_a_device_too_small_for_the_fixed_buffers_fits_no_row():
    assert xm.largest_rows("streamed", device=256 * 2**20) == 0


def test_bad_mode_and_sampling_rate_are_named():
    with pytest.raises(InvalidArgumentError, match="unknown mode 'gpu'"):
        xm.device_bytes("gpu", 10)
    with pytest.raises(InvalidArgumentError, match="sampling must be in"):
        xm.device_bytes("sampled", 10, sampling=0)


def test_the_printed_table_names_the_seed_and_what_is_left_out():
    text = xm.format_seed_table(xm.seed_table())
    assert "14,933,823" in text and "9 M" in text and "+65.9%" in text
    assert "left out: the CUDA context" in text
