"""vmalloc.offload.sequence.models: the shipped recorded sequences (no torch needed to load
them)."""

import os
import subprocess
import sys

import pytest

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload import MODELS, FunctionSequence, model_sequence
from vmalloc.offload.sequence.models import data_path

# name -> (parameters, functions, variables, persistent variables, BatchNorm buffer bytes)
EXPECTED = {
    # BN buffers: running mean + var (float32) per channel and an int64 num_batches_tracked
    "resnet50": (25_557_032, 891, 1023, 481, 26_560 * 8 + 53 * 8),
    "densenet121": (7_978_856, 2553, 2440, 1091, None),
    "unet": (31_037_698, 349, 409, 182, None),
    "gpt2-medium": (354_823_168, 1590, 1593, 584, 0),
    "resnet50-nnabla": (25_557_032, 674, 782, 429, None),
}
#: the PyTorch recordings (the parameter and momentum-buffer checks read their names)
TORCH = [n for n in MODELS if n != "resnet50-nnabla"]


def _is_param(v):
    return v.persistent and not v.name.startswith("momentum_buffer:") and v.name.rsplit(
        ".", 1)[-1] not in ("running_mean", "running_var", "num_batches_tracked")


def test_names():
    assert MODELS == ("resnet50", "densenet121", "unet", "gpt2-medium", "resnet50-nnabla")


@pytest.mark.parametrize("name", MODELS)
def test_shape_of_shipped_sequence(name):
    params, nfun, nvar, npers, bn_bytes = EXPECTED[name]
    seq = model_sequence(name, 1)
    assert seq.name == name and seq.batch == 1
    assert (len(seq.functions), len(seq.variables)) == (nfun, nvar)
    assert sum(v.persistent for v in seq.variables) == npers
    assert seq.meta["params"] == params
    assert seq.meta["dtype"] == "float32"
    assert seq.meta["recorded_at_batches"] == [2, 4]
    assert all(v.per_sample_bytes == 0 for v in seq.variables if v.persistent)
    assert os.path.getsize(data_path(name)) < 200_000
    if name not in TORCH:
        return
    # every parameter once (float32) and one SGD momentum buffer per parameter
    assert sum(v.nbytes for v in seq.variables if _is_param(v)) == 4 * params
    assert sum(v.nbytes for v in seq.variables
               if v.persistent and v.name.startswith("momentum_buffer:")) == 4 * params
    if bn_bytes is not None:
        assert seq.persistent_bytes() == 8 * params + bn_bytes


def test_resnet50_numbers():
    seq = model_sequence("resnet50", 1)
    assert seq.persistent_bytes() == 204_669_160
    names = [f.name for f in seq.functions]
    assert names.count("aten.convolution.default") == 53
    assert names.count("aten.convolution_backward.default") == 53
    # forward: 4,089,184,256 multiply-adds per 224x224 image (torchvision's "4.09 GFLOPS")
    fwd = sum(f.flops for f in seq.functions
              if f.name in ("aten.convolution.default", "aten.addmm.default"))
    assert fwd == 2 * 4_089_184_256
    # a training iteration: about 3x forward (conv1 needs no input gradient)
    assert seq.total_flops() == 24_299_077_632
    # in-core peaks (no allocator overhead, no workspaces): 190 images (the paper's in-core
    # maximum on a 16 GiB V100) need 15.54 GiB
    assert seq.at_batch(64).in_core_peak() == 5_762_141_832
    assert seq.at_batch(190).in_core_peak() == 16_686_861_960 < 16 * 2**30


def test_resnet50_nnabla_numbers():
    """The paper's workload: nnabla's ResNet-50, recorded through vmalloc.nnabla
    (scripts/record-nnabla-resnet50): nnabla's functions, forward then backward, and its
    solver calls (weight decay and update per parameter, listing no arrays)."""
    seq = model_sequence("resnet50-nnabla", 1)
    names = [f.name for f in seq.functions]
    counts = {n: names.count(n) for n in set(names)}
    assert counts == {
        "Convolution": 53, "Convolution.backward": 53, "BatchNormalization": 53,
        "BatchNormalization.backward": 53, "ReLU": 49, "ReLU.backward": 49, "Add2": 16,
        "Add2.backward": 16, "MaxPooling": 1, "MaxPooling.backward": 1, "AveragePooling": 1,
        "AveragePooling.backward": 1, "Affine": 1, "Affine.backward": 1,
        "SoftmaxCrossEntropy": 1, "SoftmaxCrossEntropy.backward": 1, "Mean": 1,
        "Mean.backward": 1, "solver": 2 * 161}
    assert all(not f.inputs and not f.outputs for f in seq.functions if f.name == "solver")
    # parameters and their gradients (float32), BatchNorm running mean and variance
    # (26,560 channels), and the 4-byte loss; nnabla's momentum state is not seen (its solver
    # hooks name no arrays)
    assert seq.persistent_bytes() == 8 * 25_557_032 + 8 * 26_560 + 4 == 204_668_740
    # the same FLOPs as PyTorch's ResNet-50 v1.5: 4,089,184,256 multiply-adds forward
    fwd = sum(f.flops for f in seq.functions if f.name in ("Convolution", "Affine"))
    assert fwd == 2 * 4_089_184_256
    assert seq.total_flops() == 24_299_077_632
    assert sum(v.per_sample_bytes for v in seq.variables) == 301_080_400
    # in-core peaks: 190 images fit a 16 GiB V100 (the paper's limit), 200 do not
    assert seq.at_batch(64).in_core_peak() == 5_650_972_484
    assert seq.at_batch(190).in_core_peak() == 16_373_382_980 < 16 * 2**30
    assert seq.at_batch(200).in_core_peak() == 17_224_367_940 > 16 * 2**30
    assert seq.meta["recorded_with"].startswith("nnabla 1.39.0")


@pytest.mark.parametrize("name", MODELS)
def test_at_batch_scales_linearly_and_monotonically(name):
    peaks, flops = [], []
    for b in (1, 2, 3, 8, 64):
        s = model_sequence(name, b)
        assert s.batch == b
        peaks.append(s.in_core_peak())
        flops.append(s.total_flops())
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert flops == sorted(flops)
    s1, s2, s3 = (model_sequence(name, b) for b in (1, 2, 3))
    for v1, v2, v3 in zip(s1.variables, s2.variables, s3.variables):
        assert v3.nbytes - v2.nbytes == v2.nbytes - v1.nbytes == v1.per_sample_bytes
    assert s3.total_flops() - s2.total_flops() == pytest.approx(
        s2.total_flops() - s1.total_flops(), rel=1e-12)


def test_flops_per_sample():
    per_sample = {n: model_sequence(n, 2).total_flops() - model_sequence(n, 1).total_flops()
                  for n in MODELS}
    assert per_sample["resnet50"] == 24_299_077_632
    assert per_sample["densenet121"] == pytest.approx(16.77e9, rel=1e-3)
    assert per_sample["unet"] == pytest.approx(1155.2e9, rel=1e-4)
    # GPT-2 medium: 6 * N * T = 2.18 TFLOP plus causal attention (counted in full)
    assert per_sample["gpt2-medium"] == pytest.approx(2532.4e9, rel=1e-4)


def test_unknown_model():
    with pytest.raises(InvalidArgumentError, match="valid names: resnet50, densenet121"):
        model_sequence("resnet18", 1)
    with pytest.raises(InvalidArgumentError):
        model_sequence("resnet50", 0)


def test_returns_independent_copies():
    a = model_sequence("unet", 4)
    a.variables.clear()
    a.meta["x"] = 1
    b = model_sequence("unet", 4)
    assert len(b.variables) == 409 and "x" not in b.meta


def test_shipped_files_are_valid_gzip_json():
    for name in MODELS:
        with open(data_path(name), "rb") as f:
            assert f.read(2) == b"\x1f\x8b"
        seq = FunctionSequence.load(data_path(name))
        assert FunctionSequence.from_dict(seq.to_dict()).to_dict() == seq.to_dict()


def test_loading_needs_no_torch(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from vmalloc.offload import model_sequence, MODELS\n"
            "print(sum(len(model_sequence(n, 8)) for n in MODELS))\n"
            "assert sys.modules['torch'] is None\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(tmp_path), env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(891 + 2553 + 349 + 1590 + 674)]


def test_damaged_copies_raise_format_errors(tmp_path):
    from vmalloc.offload import SequenceFormatError

    with open(data_path("unet"), "rb") as f:
        good = f.read()
    damaged = bytearray(good)
    damaged[100:110] = b"\xff" * 10            # corrupt deflate data (a zlib error inside)
    cases = {"flipped.gz": bytes(damaged), "truncated.gz": good[:50],
             "deep.json": b"[" * 100_000 + b"]" * 100_000}
    for fname, data in cases.items():
        p = tmp_path / fname
        p.write_bytes(data)
        with pytest.raises(SequenceFormatError, match=fname):
            FunctionSequence.load(p)
