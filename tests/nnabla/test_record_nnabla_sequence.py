"""scripts/record-nnabla-resnet50 (issue 22 item 3): the recorder of the shipped
``resnet50-nnabla`` sequence, on a small network: nnabla's function calls through
vmalloc.nnabla, FLOPs from shapes (convolution and affine, 2 x multiply-adds, backward once per
gradient), the batch-scaled bytes, and the fed input made transient."""

import importlib.machinery
import importlib.util
import pathlib

import pytest

pytest.importorskip("nnabla")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "record-nnabla-resnet50"


def _script():
    loader = importlib.machinery.SourceFileLoader("record_nnabla_resnet50", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _tiny(x, classes):
    import nnabla.functions as F
    import nnabla.parametric_functions as PF

    h = PF.convolution(x, 4, (3, 3), pad=(1, 1), with_bias=False, name="conv")
    return PF.affine(F.relu(h), classes, name="fc")


def test_records_a_small_net_with_its_flops_and_bytes():
    seq, params, version, fed = _script().record(_tiny, size=8, classes=10, name="tiny")
    assert params == 4 * 3 * 3 * 3 + 256 * 10 + 10
    assert fed == 2                       # the input batch and its labels
    names = [f.name for f in seq.functions]
    assert names == ["Convolution", "ReLU", "Affine", "SoftmaxCrossEntropy", "Mean",
                     "Mean.backward", "SoftmaxCrossEntropy.backward", "Affine.backward",
                     "ReLU.backward", "Convolution.backward"] + ["solver"] * 6
    flops = {f.name: f.per_sample_flops for f in seq.functions}
    conv = 2 * 4 * 8 * 8 * 3 * 3 * 3      # 2 * Cout * H * W * Cin * kh * kw per image
    assert flops["Convolution"] == conv
    assert flops["Convolution.backward"] == conv          # the image needs no gradient
    assert flops["Affine"] == 2 * 256 * 10
    assert flops["Affine.backward"] == 2 * 2 * 256 * 10   # weight and input gradients
    assert sum(f.flops for f in seq.functions) == conv * 2 + 2 * 256 * 10 * 3
    others = [f for f in seq.functions if f.name not in (
        "Convolution", "Convolution.backward", "Affine", "Affine.backward")]
    assert all(f.flops == 0 for f in others)
    # the image (3x8x8 float32 per sample) is transient and scales with the batch
    image = [v for v in seq.variables if v.per_sample_bytes == 3 * 8 * 8 * 4]
    assert image and not any(v.persistent for v in image)
    assert all(v.per_sample_bytes == 0 for v in seq.variables if v.persistent)
    assert seq.batch == 1 and seq.at_batch(4).batch == 4
