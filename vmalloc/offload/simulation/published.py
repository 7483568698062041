"""Every published throughput the simulator is calibrated on or validated against.

One :class:`Row` per published figure: which GPU model, framework profile and precision it is
simulated with, what ran (in core, or an out-of-core scheduler), the batch, the published
images/s, its source, and its *role*: ``calibrates`` (the figure fixed a constant of the model,
so agreement is by construction up to the fit's residual) or ``validates`` (never used to fit:
its error is the model's). ``vmalloc offload validate`` (:mod:`vmalloc.offload.planning.validate`)
simulates each beside its figure.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

from vmalloc.errors import InvalidArgumentError

__all__ = ["Row", "ROWS", "calibrated_efficiency", "fit_efficiency"]

PAPER = "Hayakawa & Narihira, Table 1 (nnabla, V100 16 GB, POWER9 NVLink 2)"
LE = "Le et al. 2019 (TensorFlow LMS, P100 16 GB, POWER8 NVLink 1)"
DLE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5 README, "
       "pytorch-21.03 container, 1 GPU; batch from configs.yml")
DLE_TF = ("NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5 README, "
          "tensorflow-20.06-tf1 container with XLA, 1 GPU of a DGX A100 (A100 40GB)")
MLPERF = ("derived: the DLE A100 AMP row x MLPerf Training v3.0 ResNet-50 time to train, Dell "
          "16x A100-SXM-80GB 14.4 min / 16x H100-SXM5-80GB 7.8 min (same CPUs)")


class Row(NamedTuple):
    """One published figure and how it is simulated."""

    source: str
    gpu: str
    profile: str
    precision: str
    #: "in-core" (compute only) or "<scheduler>+<allocator>" (planned by the planner)
    run: str
    batch: int
    images_per_second: float
    role: str               # "calibrates" or "validates"
    note: str = ""
    model: str = "resnet50"
    #: settings the source published for its run, as (name, value) pairs passed to the planner
    #: (fixed, not searched): the paper's physical chunk of 40 MB
    settings: tuple = ()


def _rows():
    out = []
    # the paper's rows run on the paper's workload: nnabla's ResNet-50 graph, recorded by
    # vmalloc.nnabla (scripts/record-nnabla-resnet50), with the physical chunk the paper chose
    # (40 MB; numbers.md). Its Schedule (caching, no VA) row and Le et al.'s LMS rows at 190-928
    # are not here: no source with their figures was found (issue 22 items 3 and 4).
    for b, ips in ((64, 336.0), (128, 492.0), (190, 581.0)):
        out.append(Row(PAPER, "v100-16gb", "nnabla", "mixed-fp32-storage", "in-core", b, ips,
                       "calibrates", "in-core row, on nnabla's graph", "resnet50-nnabla"))
    va = {64: 304, 128: 389, 190: 415, 256: 424, 512: 446, 928: 409, 1120: 398, 1248: 347,
          1440: 321}
    for b, ips in va.items():
        out.append(Row(PAPER, "v100-16gb", "nnabla", "mixed-fp32-storage", "window+virtual", b,
                       float(ips), "validates", "Schedule+VA row, on nnabla's graph, 40 MB chunks",
                       "resnet50-nnabla", (("chunk_size", "40MB"),)))
    for b, ips in ((64, 235.0), (128, 255.0), (190, 258.0)):
        out.append(Row(LE, "p100-16gb", "nnabla", "fp32", "in-core", b, ips, "calibrates",
                       "in-core row; the serial (nnabla) form fitted to TensorFlow"))
    out.append(Row(LE, "p100-16gb", "nnabla", "fp32", "lms+virtual", 775, 130.0, "validates",
                   "LMS swap only (numbers.md); parameters searched, not Le et al.'s"))
    dle = (("v100-16gb", "amp", 256, 1200.0, "calibrates", "DGX-1 16GB (8x V100 16GB)"),
           ("v100-16gb", "fp32", 112, 367.0, "calibrates", "DGX-1 16GB (8x V100 16GB)"),
           ("v100-16gb", "amp", 256, 1156.0, "validates",
            "DGX-1 32GB (8x V100 32GB): the same chip with more memory"),
           ("v100-16gb", "fp32", 112, 356.0, "validates",
            "DGX-1 32GB (8x V100 32GB): the same chip with more memory"),
           ("a100-80gb", "amp", 256, 2470.0, "calibrates",
            "DGX A100 (8x A100 80GB); its efficiency is the a100-40gb's too"),
           ("a100-80gb", "tf32", 256, 938.0, "calibrates",
            "DGX A100 (8x A100 80GB); its efficiency is the a100-40gb's too"))
    for gpu, prec, b, ips, role, note in dle:
        out.append(Row(DLE, gpu, "pytorch-eager", prec, "in-core", b, ips, role, note))
    for prec, ips in (("amp", 1770.0), ("tf32", 808.0)):
        out.append(Row(DLE_TF, "a100-40gb", "pytorch-eager", prec, "in-core", 256, ips,
                       "validates", "TensorFlow + XLA (fused), not PyTorch eager"))
    out.append(Row(MLPERF, "h100-80gb", "pytorch-eager", "amp", "in-core", 256,
                   round(2470 * 14.4 / 7.8), "calibrates",
                   "no single-GPU H100 row found: a derived anchor, not a measurement"))
    return tuple(out)


#: Every published row, in the order ``vmalloc offload validate`` prints them.
ROWS = _rows()


def _compute_only_ips(seq, gpu):
    from vmalloc.offload.simulation.simulator import in_core_seconds

    return seq.batch / in_core_seconds(seq, gpu)


def fit_efficiency(seq, gpu, images_per_second, lo=0.01, hi=1.0) -> float:
    """The efficiency (to 1e-4) at which ``seq``'s compute-only images/s on ``gpu`` (with its
    other constants) equals ``images_per_second``; ``hi`` if even that is too slow."""
    if _compute_only_ips(seq, gpu.with_(compute_efficiency=hi)) <= images_per_second:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        if _compute_only_ips(seq, gpu.with_(compute_efficiency=mid)) < images_per_second:
            lo = mid
        else:
            hi = mid
    return round(hi, 4)


def calibrating_row(fam, profile, precision) -> Optional[Row]:
    from vmalloc.offload.simulation.profiles import family

    for row in ROWS:
        if (row.role == "calibrates" and family(row.gpu) == fam and row.profile == profile
                and row.precision == precision):
            return row
    return None


@functools.lru_cache(maxsize=None)
def calibrated_efficiency(fam, profile, precision) -> float:
    """The efficiency the calibrating row of (``fam``, ``profile``, ``precision``) gives (see
    :data:`vmalloc.offload.simulation.profiles.CALIBRATIONS`), fitted on the shipped sequence."""
    from vmalloc.offload.hardware.gpus import get_gpu
    from vmalloc.offload.sequence.models import model_sequence
    from vmalloc.offload.simulation.profiles import CALIBRATIONS, PEAK_FLOPS, apply_precision

    row = calibrating_row(fam, profile, precision)
    cal = CALIBRATIONS.get((fam, profile, precision))
    if row is None or cal is None:
        raise InvalidArgumentError(f"no calibrating row for {fam} {profile} {precision}")
    gpu = get_gpu(row.gpu).with_(peak_flops=PEAK_FLOPS[fam][precision],
                                 function_overhead_seconds=cal.overhead_seconds,
                                 host_seconds=cal.host_seconds, profile=profile,
                                 precision=precision)
    seq = apply_precision(model_sequence(row.model, row.batch), precision)
    return fit_efficiency(seq, gpu, row.images_per_second)
