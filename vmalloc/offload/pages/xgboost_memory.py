"""The seed's table as a model: how many rows of a dense data set fit a GPU for XGBoost's
``gpu_hist`` in core, streamed from host pages, and streamed with gradient-based sampling.

The seed (Ou, "Out-of-Core GPU Gradient Boosting", arXiv 2005.09148, and its NVIDIA blog post)
reports, for 500 dense float columns quantised to 256 bins on a 16 GiB V100: 9 M rows in core,
13 M out of core, 85 M out of core with gradient-based sampling at f = 0.1 (:data:`SEED_ROWS`).
The paper's own memory breakdown was not found (only its abstract and third-party summaries);
the model counts the device buffers of XGBoost's GPU code of that time (v1.1, 2020), each
constant below naming the file it comes from (github.com/dmlc/xgboost, src/...):

* the ELLPACK matrix (``data/ellpack_page.cu`` ``MemCostBytes``; ``common/compressed_iterator.h``
  ``CalculateBufferSize``): ``row_stride x rows`` symbols of ``ceil(log2(total bins + 1))`` bits
  (the ``+ 1`` is the null bin; a dense matrix's row stride is its column count), plus 4 bytes
  of padding, rounded up to 4 bytes;
* per row, every mode: the gradient pair (``GradientPair``, two floats: 8 B), the learner's
  prediction cache (one float), the label (one float), and the updater's own
  ``prediction_cache`` (one float, ``GPUHistMakerDevice`` in ``tree/updater_gpu_hist.cu``) --
  :data:`ROW_STATE_BYTES`, 20 B;
* the row partitioner's ``ridx_a_/ridx_b_`` (uint32) and ``position_a_/position_b_`` (int32),
  16 B a row (``tree/gpu_hist/row_partitioner.cuh``): for the rows the tree is grown on, and,
  when sampling, for every row once the tree is done (``FinalisePosition`` re-creates it for
  ``num_row_`` rows after freeing the sample's);
* the node histogram cache, which stops growing past ``1 << 26`` values of
  ``GradientPairPrecise`` (doubles): 512 MiB (``tree/updater_gpu_hist.cu`` ``DeviceHistogram``);
* in core only: the batch of CSR entries (``Entry``: uint32 index + float, 8 B) copied to the
  device to build the ELLPACK, ``TotalMemory / (16 x row_stride x 8)`` rows
  (``EllpackPageImpl::CreateHistIndices``), alive while the ELLPACK is written -- on the first
  update, beside the gradients, the learner's cache and the labels but before the updater's
  own buffers, so the in-core peak is the larger of the two phases;
* out of core without sampling, XGBoost 1.1 concatenates every ELLPACK page into one device page
  (``tree/gpu_hist/gradient_based_sampler.cu`` ``ExternalMemoryNoSampling``): the whole matrix
  is on the device again, without the build batch, plus one 32 MiB page being copied
  (``DMatrix::kPageSize``);
* with gradient-based sampling (``ExternalMemoryGradientBasedSampling``): per row of the data
  set the sampler's ``threshold_`` and ``grad_sum_`` (floats) and ``sample_row_index_``
  (size_t), 16 B; the row partitioner of every row (above); per sampled row the compacted
  gradient pair (8 B); the compacted ELLPACK page of ``f x rows`` rows; one streamed page.

``page_stream`` is what vmalloc's :class:`~vmalloc.offload.PageStream` would need instead: the
pages stay on the host and only the working set is on the device -- ``prefetch + 1`` page slots,
the per-row state and the histograms; there is no seed figure to compare it with.

What the model leaves out (:data:`LEFT_OUT`) is listed, not estimated.
"""

from __future__ import annotations

import dataclasses
import math

from vmalloc.errors import InvalidArgumentError

#: A 16 GiB V100 (the seed's GPU), bytes.
V100_BYTES = 16 * 2**30
#: The seed's table: largest row count on a 16 GiB V100, 500 dense columns, 256 bins.
SEED_ROWS = {"in_core": 9_000_000, "streamed": 13_000_000, "sampled": 85_000_000}
SEED_SAMPLING = 0.1

GRADIENT_PAIR_BYTES = 8     # GradientPair: float gradient + float hessian
#: Per row in every mode: gradient pair, the learner's prediction cache (float), label (float),
#: the updater's prediction cache (float).
ROW_STATE_BYTES = GRADIENT_PAIR_BYTES + 4 + 4 + 4
ROW_PARTITIONER_BYTES = 16  # ridx_a_, ridx_b_ (uint32); position_a_, position_b_ (int32)
SAMPLER_ROW_BYTES = 4 + 4 + 8   # threshold_, grad_sum_ (float); sample_row_index_ (size_t)
HISTOGRAM_CACHE_BYTES = (1 << 26) * 8   # DeviceHistogram stops growing at 2^26 doubles
ENTRY_BYTES = 8             # CSR Entry: uint32 column index + float value
PAGE_BYTES = 32 << 20       # DMatrix::kPageSize: an external-memory page

LEFT_OUT = (
    "the CUDA context and cuBLAS/thrust module images (hundreds of MiB on a V100)",
    "the caching allocator's slack and fragmentation (XGBoost 1.1 allocated through a cub "
    "caching allocator and thrust device vectors)",
    "temporary storage of sorts, scans and reductions (the sampler sorts n floats)",
    "the quantile sketch's buffers while the cuts are built (up to 80 % of the free memory, "
    "through the caching allocator, before the matrix is allocated)",
    "evaluation sets and their prediction caches; a second output group",
    "the per-node split candidates, row segments and small vectors (a few MB)",
    "host memory: the pages' bytes on the host are not bounded here",
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A dense data set quantised for ``gpu_hist``: ``columns`` features, ``bins`` each."""

    columns: int = 500
    bins: int = 256

    @property
    def total_bins(self):
        return self.columns * self.bins

    @property
    def symbol_bits(self):
        """Bits per ELLPACK symbol: ``ceil(log2(total bins + 1))`` (17 for 500 x 256)."""
        return max(1, math.ceil(math.log2(self.total_bins + 1)))

    def ellpack_bytes(self, rows):
        """The compressed ELLPACK buffer of ``rows`` dense rows."""
        packed = math.ceil(rows * self.columns * self.symbol_bits / 8)
        return math.ceil((packed + 4) / 4) * 4

    def build_batch_bytes(self, device_bytes):
        """The CSR entries copied to the device at once to build the in-core ELLPACK."""
        return device_bytes // (16 * self.columns * ENTRY_BYTES) * self.columns * ENTRY_BYTES


def device_bytes(mode, rows, layout=Layout(), *, device=V100_BYTES, sampling=SEED_SAMPLING,
                 prefetch=1, page_bytes=PAGE_BYTES):
    """The model's device bytes for ``rows`` rows in ``mode``: ``"in_core"``, ``"streamed"``
    (XGBoost 1.1: pages concatenated on the device), ``"sampled"`` (gradient-based sampling at
    ``sampling``) or ``"page_stream"`` (pages on the host, only the working set on the device:
    ``prefetch + 1`` slots of ``page_bytes``)."""
    rows = int(rows)
    fixed = HISTOGRAM_CACHE_BYTES
    if mode == "in_core":
        # The matrix is built on the first update, once the gradients, the learner's cache
        # and the labels are on the device; the build batch is gone before the updater's
        # cache, the partitioner and the histograms come: the peak is the larger phase.
        early = GRADIENT_PAIR_BYTES + 4 + 4
        build = layout.build_batch_bytes(device)
        train = rows * (ROW_STATE_BYTES - early + ROW_PARTITIONER_BYTES) + fixed
        return layout.ellpack_bytes(rows) + rows * early + max(build, train)
    if mode == "streamed":
        return (layout.ellpack_bytes(rows) + rows * (ROW_STATE_BYTES + ROW_PARTITIONER_BYTES)
                + page_bytes + fixed)
    if mode == "sampled":
        if not 0 < sampling <= 1:
            raise InvalidArgumentError(f"sampling must be in (0, 1], not {sampling}")
        sampled = math.ceil(rows * sampling)
        # The sample's row partitioner is freed before FinalisePosition makes one for every
        # row, so the peak holds the latter only.
        return (layout.ellpack_bytes(sampled)
                + rows * (ROW_STATE_BYTES + SAMPLER_ROW_BYTES + ROW_PARTITIONER_BYTES)
                + sampled * GRADIENT_PAIR_BYTES + page_bytes + fixed)
    if mode == "page_stream":
        return (rows * (ROW_STATE_BYTES + ROW_PARTITIONER_BYTES) + (prefetch + 1) * page_bytes
                + fixed)
    raise InvalidArgumentError(f"unknown mode {mode!r}; choose from in_core, streamed, "
                               "sampled, page_stream")


def largest_rows(mode, layout=Layout(), *, device=V100_BYTES, **kwargs):
    """The largest row count whose :func:`device_bytes` fits ``device`` bytes (0 if none)."""
    if device_bytes(mode, 0, layout, device=device, **kwargs) > device:
        return 0
    lo, hi = 0, 1
    while device_bytes(mode, hi, layout, device=device, **kwargs) <= device:
        lo, hi = hi, hi * 2
    while hi - lo > 1:      # device_bytes grows with rows: bisect
        mid = (lo + hi) // 2
        if device_bytes(mode, mid, layout, device=device, **kwargs) <= device:
            lo = mid
        else:
            hi = mid
    return lo


def seed_table(layout=Layout(), *, device=V100_BYTES, sampling=SEED_SAMPLING):
    """Rows: one dict per mode with ``mode``, ``model`` (largest rows), ``seed`` (the published
    figure or None), ``error`` (model / seed - 1, signed, or None) and ``missing_per_row``:
    the device bytes per row the model would have to add to stop at the seed's row count
    (``(device - device_bytes(seed)) / seed``: where the model's gap is, per row)."""
    out = []
    for mode in ("in_core", "streamed", "sampled", "page_stream"):
        rows = largest_rows(mode, layout, device=device, sampling=sampling)
        seed = SEED_ROWS.get(mode)
        error = missing = None
        if seed is not None:
            error = rows / seed - 1
            used = device_bytes(mode, seed, layout, device=device, sampling=sampling)
            missing = (device - used) / seed
        out.append(dict(mode=mode, model=rows, seed=seed, error=error,
                        missing_per_row=missing))
    return out


def format_seed_table(rows):
    """The table as text, one line a mode, then what the model leaves out."""
    names = {"in_core": "in core", "streamed": "streamed (pages concatenated)",
             "sampled": f"streamed, gradient-based f = {SEED_SAMPLING}",
             "page_stream": "vmalloc PageStream (working set only)"}
    lines = [f"{'mode':<40} {'model rows':>12} {'seed rows':>10} {'error':>8} "
             f"{'missing B/row':>13}"]
    for r in rows:
        seed = "-" if r["seed"] is None else f"{r['seed'] / 1e6:.0f} M"
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        gap = "-" if r["missing_per_row"] is None else f"{r['missing_per_row']:.1f}"
        lines.append(f"{names[r['mode']]:<40} {r['model']:>12,} {seed:>10} {err:>8} {gap:>13}")
    lines.append("left out: " + "; ".join(LEFT_OUT))
    return "\n".join(lines)
