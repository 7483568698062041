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
    assert xm.HISTOGRAM_CACHE_BYTES == hist
    assert xm.device_bytes("in_core", n) == ell(n) + 32 * n + 1_073_740_000 + hist
    assert xm.device_bytes("streamed", n) == ell(n) + 32 * n + 32 * 2**20 + hist
    # f = 0.1: the compacted page of 100,000 rows; 16 B of row state and 16 B of sampler
    # buffers for every row; 24 B per sampled row.
    assert xm.device_bytes("sampled", n) == (ell(100_000) + 32 * n + 24 * 100_000
                                             + 32 * 2**20 + hist)
    assert xm.device_bytes("page_stream", n, prefetch=3) == 32 * n + 4 * 32 * 2**20 + hist


def test_largest_rows_on_a_16_gib_v100_against_the_seed():
    table = {r["mode"]: r for r in xm.seed_table()}
    assert {m: r["model"] for m, r in table.items()} == {
        "in_core": 14_224_996, "streamed": 15_175_371, "sampled": 118_090_600,
        "page_stream": 517_996_544}
    assert {m: r["seed"] for m, r in table.items()} == {
        "in_core": 9_000_000, "streamed": 13_000_000, "sampled": 85_000_000,
        "page_stream": None}
    # Signed errors (model / seed - 1): the model over-estimates every row of the table.
    assert table["in_core"]["error"] == pytest.approx(14_224_996 / 9e6 - 1)
    assert round(table["in_core"]["error"], 4) == 0.5806
    assert round(table["streamed"]["error"], 4) == 0.1673
    assert round(table["sampled"]["error"], 4) == 0.3893
    assert [round(table[m]["missing_per_row"], 1) for m in ("in_core", "streamed", "sampled")] \
        == [635.4, 183.1, 54.8]
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
    assert "14,224,996" in text and "9 M" in text and "+58.1%" in text
    assert "left out: the CUDA context" in text
