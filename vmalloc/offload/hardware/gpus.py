"""Models of GPUs for the out-of-core simulator (:func:`vmalloc.offload.simulate`).

Each :class:`GPU` holds the few constants the simulator needs: device memory, the compute
peak and efficiency used for training, HBM bandwidth, the host<->device link bandwidth in
each direction alone and with both directions busy, and a per-function overhead. Every
figure names its source (``sources``); the published figures live in
``/work/shared/reference/numbers.md`` and ``offload.md`` of the project and are repeated in
``docs/simulating.rst``.

Calibration (``v100-16gb``): the paper's in-core baseline (Hayakawa & Narihira, Table 1:
336 / 492 / 581 images/s for ResNet-50 at batch 64 / 128 / 190) is almost exactly linear in
the batch: 1.085 ms per image plus a fixed 0.121 s per iteration. The per-image slope fixes
``compute_efficiency`` (the fraction of ``peak_flops`` a training kernel reaches, for the
FLOPs of the shipped ResNet-50 sequence), the intercept fixes ``function_overhead_seconds``
(the framework's cost per function: nnabla's per-function Python/C++ dispatch, far above a
bare kernel launch). See :func:`calibrate` for the fit. These entries are the raw models;
:func:`vmalloc.offload.simulation.profiles.profiled_gpu` gives each GPU the constants its own published
rows calibrate for a framework profile and a precision (what the CLI simulates with).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Tuple

from vmalloc.errors import InvalidArgumentError

__all__ = ["GPU", "GPUS", "get_gpu", "calibrate", "PAPER_IN_CORE", "LE_IN_CORE"]

GB = 1e9

#: The paper's in-core baseline, ResNet-50 on V100 16 GB (Table 1): batch -> images/s.
PAPER_IN_CORE = {64: 336.0, 128: 492.0, 190: 581.0}


@dataclass(frozen=True)
class GPU:
    """One GPU as the simulator sees it. Bandwidths in bytes/s, FLOP rates in FLOP/s."""

    name: str
    memory_bytes: int
    #: Peak FLOP rate of the arithmetic a training step uses (see ``precision``).
    peak_flops: float
    #: Fraction of ``peak_flops`` training kernels reach (calibrated on the V100).
    compute_efficiency: float
    #: Device memory (HBM) bandwidth: memory-bound functions run at bytes touched / this.
    hbm_bandwidth: float
    #: Host-to-device copy bandwidth with only that direction busy.
    h2d_bandwidth: float
    #: Device-to-host copy bandwidth with only that direction busy.
    d2h_bandwidth: float
    #: Each direction's bandwidth while both copy engines are busy.
    bidirectional_bandwidth: float
    #: Fixed cost per function (kernel launches and the framework's dispatch), seconds.
    function_overhead_seconds: float
    link: str = ""
    precision: str = ""
    sources: Tuple[str, ...] = field(default_factory=tuple)
    #: The framework profile (vmalloc.offload.simulation.profiles): "nnabla" (the per-function cost is on
    #: the compute stream) or "pytorch-eager" (``host_seconds`` per launch on a host timeline).
    profile: str = "nnabla"
    #: Host cost per function, overlapped with the GPU (pytorch-eager); 0 for nnabla.
    host_seconds: float = 0.0

    def compute_seconds(self, flops, nbytes):
        """The model's time for one function of ``flops`` touching ``nbytes``:
        ``max(flops / (peak * efficiency), nbytes / hbm) + overhead``."""
        t = 0.0
        if flops:
            t = flops / (self.peak_flops * self.compute_efficiency)
        if nbytes:
            t = max(t, nbytes / self.hbm_bandwidth)
        return t + self.function_overhead_seconds

    def with_(self, **changes) -> "GPU":
        """A copy with some constants changed (e.g. ``h2d_bandwidth=math.inf``)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        for k, v in d.items():
            if isinstance(v, float) and math.isinf(v):
                d[k] = "inf"
        return d


# Calibrated on the paper's in-core row with the shipped resnet50 sequence (891 functions):
# calibrate(lambda b: model_sequence("resnet50", b)) -> efficiency 0.396, overhead 135.3 us;
# the model then gives 335.8 / 492.4 / 580.8 images/s at batch 64 / 128 / 190 (paper: 336 /
# 492 / 581; errors -0.05 %, +0.09 %, -0.04 %).
V100_EFFICIENCY = 0.396
V100_OVERHEAD = 135.3e-6

_V100_SOURCES = (
    "memory 16 GB, NVLink 2 to POWER9: Hayakawa & Narihira (seed paper), setup",
    "peak 125 TFLOP/s mixed-precision tensor cores, HBM2 900 GB/s: NVIDIA V100 datasheet "
    "(the paper's in-core ResNet-50 rate, 22 TFLOP/s of training FLOPs at batch 190, exceeds "
    "the 15.7 TFLOP/s FP32 peak, so its nnabla run used tensor cores)",
    "link 45.9 GB/s per direction: POWER9 NVLink 2 measured with 3 GPUs per CPU (2 bricks, "
    "2x25 GB/s); the paper quotes 2x50 GB/s (offload.md, NextPlatform chart)",
    "efficiency and per-function overhead: fitted to the paper's Table 1 in-core row "
    "336/492/581 img/s at batch 64/128/190 (vmalloc.offload.hardware.gpus.calibrate)",
)

_V100 = GPU(
    name="v100-16gb",
    memory_bytes=16 * 2**30,
    peak_flops=125e12,
    compute_efficiency=V100_EFFICIENCY,
    hbm_bandwidth=900 * GB,
    h2d_bandwidth=45.9 * GB,
    d2h_bandwidth=45.9 * GB,
    bidirectional_bandwidth=45.9 * GB,   # NVLink: each direction has its own lanes
    function_overhead_seconds=V100_OVERHEAD,
    link="NVLink 2 to POWER9 (2 bricks)",
    precision="mixed-fp32-storage",
    sources=_V100_SOURCES,
)
# The raw A100 and H100 entries carry the V100's nnabla fit on their own peaks (profile nnabla,
# precision mixed-fp32-storage, as labelled); what the CLI simulates with is
# vmalloc.offload.simulation.profiles.profiled_gpu, calibrated on each GPU's own published rows.
_A100_40 = GPU(
    name="a100-40gb",
    memory_bytes=40 * 2**30,
    peak_flops=312e12,
    compute_efficiency=V100_EFFICIENCY,
    hbm_bandwidth=1555 * GB,
    h2d_bandwidth=25 * GB,
    d2h_bandwidth=25 * GB,
    bidirectional_bandwidth=25 * GB * 52.8 / 55.2,
    function_overhead_seconds=V100_OVERHEAD,
    link="PCIe 4 x16",
    precision="mixed-fp32-storage",
    sources=(
        "peak 312 TFLOP/s BF16/FP16 tensor, HBM2 1555 GB/s: NVIDIA A100 datasheet",
        "PCIe 4 x16 ~25 GB/s: nvbandwidth issue 42 (offload.md)",
        "both directions at once: the H800's ratio 52.8/55.2 applied (numbers.md); "
        "no A100 figure found",
        "efficiency and overhead: the V100's (uncalibrated; the CLI and validate use "
        "vmalloc.offload.simulation.profiles.profiled_gpu, calibrated on the A100's own rows)",
    ),
)

# P100 (Le et al.'s machine), calibrated ONLY on Le et al.'s in-core row (235 / 255 / 258
# images/s for ResNet-50 at batch 64 / 128 / 190, TensorFlow FP32; numbers.md "Older GPUs"):
# calibrate(lambda b: model_sequence("resnet50", b), {64: 235, 128: 255, 190: 258},
# peak_flops=10.6e12, hbm_bandwidth=732e9) -> efficiency 0.757, overhead 37.84 us; the model
# then gives 236.8 / 252.9 / 257.5 images/s (errors +0.78 %, -0.82 %, -0.19 %). No LMS figure
# was used: simulated LMS is compared with Le et al.'s published LMS rows in
# docs/benchmarks.md.
P100_EFFICIENCY = 0.757
P100_OVERHEAD = 37.84e-6
#: Le et al.'s in-core row, ResNet-50 on P100 16 GB: batch -> images/s.
LE_IN_CORE = {64: 235.0, 128: 255.0, 190: 258.0}

_P100 = GPU(
    name="p100-16gb",
    memory_bytes=16 * 2**30,
    peak_flops=10.6e12,
    compute_efficiency=P100_EFFICIENCY,
    hbm_bandwidth=732 * GB,
    h2d_bandwidth=40 * GB,
    d2h_bandwidth=40 * GB,
    bidirectional_bandwidth=40 * GB,    # NVLink: each direction has its own lanes
    function_overhead_seconds=P100_OVERHEAD,
    link="NVLink 1 to POWER8 (2 links)",
    precision="fp32",
    sources=(
        "P100 SXM2 16 GB: FP32 10.6 TFLOP/s, HBM2 732 GB/s (NVIDIA datasheet, numbers.md)",
        "link: NVLink 1.0, 20 GB/s per direction per link, two links to the POWER8 CPU "
        "(IBM Minsky): 40 GB/s per direction, the nominal figure (no measurement found)",
        "efficiency and per-function overhead: fitted ONLY to Le et al.'s in-core row "
        "235/255/258 img/s at batch 64/128/190 (vmalloc.offload.hardware.gpus.calibrate)",
    ),
)

GPUS: Dict[str, GPU] = {
    "v100-16gb": _V100,
    # The same V100 in a 4-GPU POWER9 node: 2 GPUs per CPU, 3 NVLink bricks each. The link is
    # the one measurement that differs; with it the simulated window+virtual speed at batch
    # 1440 lands on the paper's Table 1 figure (docs/benchmarks.md), which suggests the paper's
    # machine was of this kind.
    "v100-16gb-3brick": replace(
        _V100,
        name="v100-16gb-3brick",
        h2d_bandwidth=68 * GB,
        d2h_bandwidth=68 * GB,
        bidirectional_bandwidth=68 * GB,
        link="NVLink 2 to POWER9 (3 bricks)",
        sources=_V100_SOURCES[:2] + (
            "link 68 GB/s per direction: POWER9 NVLink 2 measured with 2 GPUs per CPU (3 "
            "bricks) (offload.md, NextPlatform chart)",) + _V100_SOURCES[3:],
    ),
    "p100-16gb": _P100,
    "a100-40gb": _A100_40,
    "a100-80gb": replace(  # HBM2e; otherwise the 40 GB one
        _A100_40,
        name="a100-80gb",
        memory_bytes=80 * 2**30,
        hbm_bandwidth=2039 * GB,
        sources=(
            "peak 312 TFLOP/s BF16/FP16 tensor, HBM2e 2039 GB/s: NVIDIA A100 datasheet",
            "PCIe 4 x16 ~25 GB/s: nvbandwidth issue 42 (offload.md)",
            "both directions at once: the H800's ratio 52.8/55.2 applied (numbers.md)",
            "efficiency and overhead: the V100's (uncalibrated; see profiled_gpu)",
        ),
    ),
    "h100-80gb": GPU(
        name="h100-80gb",
        memory_bytes=80 * 2**30,
        peak_flops=989e12,
        compute_efficiency=V100_EFFICIENCY,
        hbm_bandwidth=3350 * GB,
        h2d_bandwidth=55.3 * GB,
        d2h_bandwidth=55.1 * GB,
        bidirectional_bandwidth=52.8 * GB,
        function_overhead_seconds=V100_OVERHEAD,
        link="PCIe 5 x16",
        precision="mixed-fp32-storage",
        sources=(
            "peak 989 TFLOP/s BF16/FP16 dense tensor, HBM3 3.35 TB/s: NVIDIA H100 datasheet "
            "(numbers.md)",
            "PCIe 5 x16 copy engines: H2D 55.3, D2H 55.1, both at once 52.8 GB/s each "
            "(nvbandwidth v0.2 on H800, numbers.md)",
            "efficiency and overhead: the V100's (uncalibrated; see profiled_gpu)",
        ),
    ),
}


def get_gpu(gpu) -> GPU:
    """The :class:`GPU` named ``gpu`` (a key of :data:`GPUS`), or ``gpu`` itself if it is one.
    Raises InvalidArgumentError listing the names for anything else."""
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, str) and gpu.lower() in GPUS:
        return GPUS[gpu.lower()]
    raise InvalidArgumentError(f"unknown GPU {gpu!r}; choose from {', '.join(GPUS)}")


def calibrate(seq_at_batch, points=None, peak_flops=125e12, hbm_bandwidth=900 * GB):
    """Fits ``(compute_efficiency, function_overhead_seconds)`` so that the in-core model
    time of ``seq_at_batch(b)`` matches ``points`` ({batch: images/s}, default the paper's
    V100 row): for each efficiency on a fine grid the overhead is the least-squares fit of
    ``iteration seconds = sum max(flops / (peak * eff), bytes / hbm) + n * overhead``; the
    efficiency with the smallest squared error wins. Returns (efficiency, overhead, errors)
    where ``errors`` maps each batch to the model's relative error in images/s."""
    points = dict(points or PAPER_IN_CORE)
    data = []
    for b, ips in sorted(points.items()):
        seq = seq_at_batch(b)
        var = seq.variables
        fl = [(f.flops or 0.0, sum(var[v].nbytes for v in f.uses)) for f in seq.functions]
        data.append((b, b / ips, len(fl), fl))

    def fit(eff):
        rows = []
        for b, y, n, fl in data:
            t = sum(max(f / (peak_flops * eff), m / hbm_bandwidth) for f, m in fl)
            rows.append((y - t, n))
        ov = sum(r * n for r, n in rows) / sum(n * n for _, n in rows)
        ov = max(ov, 0.0)
        err = sum((r - n * ov) ** 2 for r, n in rows)
        return err, ov

    best = None
    for k in range(1, 1001):
        eff = k / 1000
        err, ov = fit(eff)
        if best is None or err < best[0]:
            best = (err, eff, ov)
    _, eff, ov = best
    errors = {}
    for b, y, n, fl in data:
        t = sum(max(f / (peak_flops * eff), m / hbm_bandwidth) for f, m in fl) + n * ov
        errors[b] = (b / t) / (b / y) - 1
    return eff, ov, errors
