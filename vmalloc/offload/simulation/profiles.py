"""Compute profiles: which framework's timing and which precision a simulation models.

A simulation's compute time depends on more than the GPU: on how the framework issues work
(the *profile*) and on the arithmetic it uses (the *precision*). Both are part of every
simulation (:func:`profiled_gpu` bakes them into the :class:`~vmalloc.offload.GPU` the simulator
runs on) and printed with it.

Profiles:

- ``nnabla`` -- the paper's framework: each function pays a fixed host cost that the GPU waits
  for (nnabla's per-function dispatch is not hidden). Per function: ``max(flops / (peak * eff),
  bytes / HBM) + overhead``, all on the compute stream. Calibrated on the paper's in-core row
  (V100) and on Le et al.'s (P100, TensorFlow: the same serial form fitted to its row).
- ``pytorch-eager`` -- kernel launches run ahead of the GPU on a host timeline: the host spends
  ``host_seconds`` issuing each function, the GPU runs the kernel when both the previous kernel
  and the launch are done, so the host cost is hidden whenever kernels are longer. vmalloc's own
  predictions use this profile.

Precisions:

- ``fp32``: the FP32 (non-tensor-core) peak; activations stored as recorded (float32).
- ``tf32``: TF32 tensor cores (A100, H100); activations float32.
- ``amp``: FP16/BF16 tensor cores; batch-scaled float activations stored at half their bytes
  (:func:`apply_precision`), parameters, optimizer state, the input and integer tensors not.
- ``mixed-fp32-storage``: the ``nnabla`` V100 fit only. The paper's in-core row needs about
  22 TFLOP/s of this graph's training FLOPs at the margin (above the V100's 15.7 TFLOP/s FP32
  peak, so tensor cores ran) while its in-core limit (batch 190 in 16 GB) is what float32
  activations of the recorded graph give; the fit keeps both and says so rather than calling
  itself ``fp32`` or ``amp``.

Each (GPU family, profile, precision) exists only where a published row calibrates it
(:data:`CALIBRATIONS`); the rows, and the ones that only validate, are in
:mod:`vmalloc.offload.simulation.published` and ``vmalloc offload validate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from vmalloc.errors import InvalidArgumentError

__all__ = ["PROFILES", "PRECISIONS", "PEAK_FLOPS", "CALIBRATIONS", "MODEL_CALIBRATIONS",
           "Calibration",
           "profiled_gpu", "apply_precision", "host_chain_seconds", "default_profile",
           "default_precision", "family"]

PROFILES = {
    "nnabla": "host cost per function not hidden (the paper's nnabla; today's fit)",
    "pytorch-eager": "kernel launches run ahead of the GPU on a host timeline; the host cost "
                     "is hidden when kernels are longer",
}
PRECISIONS = ("fp32", "tf32", "amp", "mixed-fp32-storage")

#: Peak FLOP/s per GPU family and precision (dense; NVIDIA datasheets, numbers.md): V100 FP32
#: 15.7, tensor 125; P100 FP32 10.6; A100 FP32 19.5, TF32 156, FP16/BF16 312; H100 SXM FP32 67,
#: TF32 495, FP16/BF16 989 TFLOP/s.
PEAK_FLOPS: Dict[str, Dict[str, float]] = {
    "v100": {"fp32": 15.7e12, "amp": 125e12, "mixed-fp32-storage": 125e12},
    "p100": {"fp32": 10.6e12},
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "amp": 312e12},
    "h100": {"fp32": 67e12, "tf32": 495e12, "amp": 989e12},
}

#: pytorch-eager's host cost per function (aten op): dispatch plus cudaLaunchKernel. An
#: assumption of the order PyTorch's eager overhead is usually quoted at (about 10 us per op);
#: no published per-op figure is in numbers.md. At the calibration batches (112-256) ResNet-50's
#: kernels are longer, so the figure only matters for small batches and the optimizer's
#: per-parameter ops.
EAGER_HOST_SECONDS = 10e-6


@dataclass(frozen=True)
class Calibration:
    """The constants one published row (or row set) fixes for a (family, profile, precision)."""

    efficiency: float
    #: Cost per function on the compute stream (nnabla: the whole host cost; eager: 0).
    overhead_seconds: float
    #: Host cost per function on the host timeline (pytorch-eager only).
    host_seconds: float
    source: str


# Efficiencies below: vmalloc.offload.simulation.published.fit_efficiency on the shipped resnet50 sequence
# (pytorch-eager: host 10 us, no stream overhead; the efficiency that makes the compute-only
# time at the row's batch give its images/s). Each row is in published.ROWS as "calibrates".
CALIBRATIONS: Dict[Tuple[str, str, str], Calibration] = {
    # the paper's in-core row 336/492/581 at 64/128/190 (Hayakawa & Narihira, Table 1); fit of
    # gpus.calibrate: 0.396 / 135.3 us (errors in `vmalloc offload validate`)
    ("v100", "nnabla", "mixed-fp32-storage"): Calibration(
        0.396, 135.3e-6, 0.0, "the paper's in-core row (Hayakawa & Narihira, Table 1), nnabla"),
    # Le et al.'s in-core row 235/255/258 at 64/128/190 (TensorFlow FP32): 0.757 / 37.84 us
    ("p100", "nnabla", "fp32"): Calibration(
        0.757, 37.84e-6, 0.0, "Le et al.'s in-core row (TensorFlow, P100), serial fit"),
    # NVIDIA Deep Learning Examples, PyTorch ResNet-50 v1.5, pytorch-21.03 container, 1 GPU of a
    # DGX-1 16 GB (8x V100 16GB): mixed precision 1200 img/s (batch 256, configs.yml DGX1V AMP),
    # FP32 367 img/s (batch 112, DGX1V FP32)
    ("v100", "pytorch-eager", "amp"): Calibration(
        None, 0.0, EAGER_HOST_SECONDS,
        "NVIDIA DeepLearningExamples PyTorch RN50 v1.5 (21.03), 1x V100 16GB AMP: 1200 img/s "
        "at batch 256"),
    ("v100", "pytorch-eager", "fp32"): Calibration(
        None, 0.0, EAGER_HOST_SECONDS,
        "NVIDIA DeepLearningExamples PyTorch RN50 v1.5 (21.03), 1x V100 16GB FP32: 367 img/s "
        "at batch 112"),
    # the same tables, 1 GPU of a DGX A100 (8x A100 80GB): TF32 938, mixed precision 2470 img/s
    # at batch 256. No PyTorch row of the 40 GB A100 was found: the 80 GB one has the same SMs
    # and clocks, and the model's HBM term carries the 1555 vs 2039 GB/s difference.
    ("a100", "pytorch-eager", "amp"): Calibration(
        None, 0.0, EAGER_HOST_SECONDS,
        "NVIDIA DeepLearningExamples PyTorch RN50 v1.5 (21.03), 1x A100 80GB AMP: 2470 img/s "
        "at batch 256"),
    ("a100", "pytorch-eager", "tf32"): Calibration(
        None, 0.0, EAGER_HOST_SECONDS,
        "NVIDIA DeepLearningExamples PyTorch RN50 v1.5 (21.03), 1x A100 80GB TF32: 938 img/s "
        "at batch 256"),
    # No single-GPU H100 ResNet-50 PyTorch row was found. Derived anchor: the A100 row above
    # times the H100/A100 ratio of MLPerf Training v3.0's ResNet-50 time to train in two Dell
    # submissions with the same CPUs and 16 GPUs each (A100-SXM-80GB 14.4 min, H100-SXM5-80GB
    # 7.8 min: 1.846x): 2470 x 14.4 / 7.8 = 4560 img/s at batch 256. Derived, not measured.
    ("h100", "pytorch-eager", "amp"): Calibration(
        None, 0.0, EAGER_HOST_SECONDS,
        "derived: A100 PyTorch AMP 2470 img/s x MLPerf Training v3.0 ResNet-50 H100/A100 "
        "time-to-train ratio 14.4/7.8 (Dell, 16 GPUs each) = 4560 img/s at batch 256"),
}


#: Calibrations fitted on one shipped model's own graph, used where that model is simulated
#: (``profiled_gpu(..., model=...)``). The paper's in-core row (the same calibrating rows,
#: 336/492/581 at 64/128/190) fitted on the graph the paper ran, nnabla's ResNet-50
#: (``resnet50-nnabla``, 674 functions), by gpus.calibrate(lambda b:
#: model_sequence("resnet50-nnabla", b)): efficiency 0.464, overhead 179.75 us per function
#: (errors -0.05 %, +0.09 %, -0.04 %). On PyTorch's graph (891 functions) the same rows give
#: 0.396 / 135.3 us: the per-function cost is a property of the graph it is spread over.
MODEL_CALIBRATIONS: Dict[Tuple[str, str, str, str], Calibration] = {
    ("v100", "nnabla", "mixed-fp32-storage", "resnet50-nnabla"): Calibration(
        0.464, 179.75e-6, 0.0,
        "the paper's in-core row (Hayakawa & Narihira, Table 1), fitted on nnabla's graph"),
}


def family(gpu) -> str:
    """``"v100"`` for ``"v100-16gb-3brick"``: the chip whose calibrations a model uses."""
    name = gpu if isinstance(gpu, str) else gpu.name
    return name.split("-")[0].lower()


def default_profile(gpu, purpose="predict") -> str:
    """``pytorch-eager`` for vmalloc's own predictions where it is calibrated, ``nnabla`` for
    the paper's comparison (``purpose="paper"``) where it is; otherwise the one that exists."""
    fam = family(gpu)
    have = {p for (f, p, _) in CALIBRATIONS if f == fam}
    first = "nnabla" if purpose == "paper" else "pytorch-eager"
    if first in have:
        return first
    return sorted(have)[0] if have else "nnabla"


def default_precision(gpu, profile) -> str:
    """``amp`` where calibrated for the profile, else the one precision that is."""
    fam = family(gpu)
    have = [p for (f, pr, p) in CALIBRATIONS if f == fam and pr == profile]
    return "amp" if "amp" in have else (have[0] if have else "fp32")


def profiled_gpu(gpu, profile=None, precision=None, purpose="predict", model=None):
    """The GPU model ``gpu`` (a name or a :class:`GPU`) with ``profile``'s and ``precision``'s
    calibrated constants: peak, efficiency, per-function costs, and both names recorded on it.
    ``model``: the shipped model to be simulated; where :data:`MODEL_CALIBRATIONS` has a fit on
    that model's own graph (the paper's rows on nnabla's ResNet-50), it is used instead.
    Raises InvalidArgumentError naming what is calibrated when the combination is not."""
    from vmalloc.offload.hardware.gpus import get_gpu
    from vmalloc.offload.simulation import published

    base = get_gpu(gpu)
    profile = profile or default_profile(base, purpose)
    if profile not in PROFILES:
        raise InvalidArgumentError(
            f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
    precision = precision or default_precision(base, profile)
    if precision not in PRECISIONS:
        raise InvalidArgumentError(
            f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    fam = family(base)
    cal = MODEL_CALIBRATIONS.get((fam, profile, precision, model)) or CALIBRATIONS.get(
        (fam, profile, precision))
    if cal is None:
        have = sorted(f"{p}/{q}" for (f, p, q) in CALIBRATIONS if f == fam)
        raise InvalidArgumentError(
            f"no published row calibrates {base.name} with profile {profile} and precision "
            f"{precision}; calibrated: {', '.join(have) or 'none'}")
    eff = cal.efficiency
    if eff is None:
        eff = published.calibrated_efficiency(fam, profile, precision)
    sources = tuple(s for s in base.sources if "efficiency" not in s) + (
        f"profile {profile}, precision {precision}: {cal.source}",)
    return base.with_(peak_flops=PEAK_FLOPS[fam][precision], compute_efficiency=eff,
                      function_overhead_seconds=cal.overhead_seconds,
                      host_seconds=cal.host_seconds, profile=profile, precision=precision,
                      sources=sources)


def _halved(v):
    # integer tensors (max-pool indices, class targets) and the fp32 input keep their bytes
    name = v.name
    if v.persistent or not v.per_sample_bytes or name.startswith(("input", "target")):
        return False
    return not (name.startswith("aten.max_pool2d_with_indices") and name.endswith(":1"))


def apply_precision(seq, precision):
    """``seq`` as ``precision`` stores it: under ``amp`` every batch-scaled float activation
    at half its bytes (not parameters, optimizer state, the fp32 input or integer
    tensors); other precisions return ``seq`` unchanged.
    Marks ``seq.meta["precision"]``."""
    if precision not in PRECISIONS:
        raise InvalidArgumentError(
            f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if precision != "amp" or seq.meta.get("precision") == "amp":
        return seq
    from vmalloc.offload.sequence.sequence import FunctionSequence

    out = FunctionSequence(seq.name, seq.batch, dict(seq.meta, precision="amp"))
    for v in seq.variables:
        if _halved(v):
            v = v._replace(nbytes=v.nbytes // 2, per_sample_bytes=v.per_sample_bytes // 2)
        out.variables.append(v)
    out.functions = list(seq.functions)
    return out


def host_chain_seconds(durations, host_seconds) -> float:
    """Compute-only time of kernels ``durations`` launched ``host_seconds`` apart at least, the
    host at most one function ahead (the simulator's host model with no swaps)."""
    c = h = start = 0.0
    for d in durations:
        h = max(h, start) + host_seconds
        start = max(c, h)
        c = start + d
    return c
