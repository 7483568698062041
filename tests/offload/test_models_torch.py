"""The torch.nn model definitions, and the shipped sequences are what the recorder makes now."""

import pytest

torch = pytest.importorskip("torch")

from vmalloc.offload import model_sequence  # noqa: E402
from vmalloc.offload.sequence.recorder import record  # noqa: E402
from vmalloc.offload.sequence.torch_models import BUILDERS, build  # noqa: E402


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts():
    with torch.device("meta"):
        counts = {name: _params(build(name)[0]) for name in BUILDERS}
    assert counts == {
        "resnet50": 25_557_032,       # torchvision resnet50
        "densenet121": 7_978_856,     # torchvision densenet121
        "unet": 31_037_698,
        "gpt2-medium": 354_823_168,   # HF gpt2-medium (tied lm head)
    }


def test_unet_parameter_count_by_hand():
    def conv(cin, cout, k, bias):
        return cin * cout * k * k + (cout if bias else 0)

    def double(cin, cout):   # two 3x3 convs without bias, each with BatchNorm (2 * cout)
        return conv(cin, cout, 3, False) + conv(cout, cout, 3, False) + 4 * cout

    w = (64, 128, 256, 512, 1024)
    n = double(3, 64) + sum(double(w[i], w[i + 1]) for i in range(4))
    n += sum(conv(w[i + 1], w[i], 2, True) + double(2 * w[i], w[i]) for i in range(4))
    n += conv(64, 2, 1, True)
    assert n == 31_037_698


def test_gpt2_medium_parameter_count_by_hand():
    d, v, t, layers = 1024, 50257, 1024, 24
    per_layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) \
        + (4 * d * d + d)
    assert v * d + t * d + layers * per_layer + 2 * d == 354_823_168


def test_resnet50_forward_on_cpu_shapes():
    model = build("resnet50")[0].eval()
    with torch.no_grad():
        out = model(torch.zeros(1, 3, 64, 64))
    assert out.shape == (1, 1000)


def test_gpt_attention_is_causal_sdpa_on_cpu():
    from vmalloc.offload.sequence.torch_models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=11, n_ctx=8, n_layer=2, d_model=16, n_head=2).eval()
    idx = torch.randint(0, 11, (1, 8))
    with torch.no_grad():
        full = model(idx)
        prefix = model(idx[:, :5])
    assert torch.allclose(full[:, :5], prefix, atol=1e-5)   # no look-ahead


@pytest.mark.parametrize("name", ["resnet50", "unet"])
def test_shipped_sequence_is_up_to_date(name):
    with torch.device("meta"):
        model, inputs_fn, loss_fn, meta = build(name)
    fresh = record(model, inputs_fn, loss_fn, name=name, batch=1, meta=meta).to_dict()
    shipped = model_sequence(name).to_dict()
    fresh["meta"].pop("recorded_with")
    shipped["meta"].pop("recorded_with")
    assert fresh["functions"] == shipped["functions"], \
        "regenerate with: python benchmarks/record_sequences.py"
    assert fresh == shipped


def test_resnet50_scaled_equals_direct_recording_at_batch_3():
    with torch.device("meta"):
        model, inputs_fn, loss_fn, meta = build("resnet50")
    direct = record(model, inputs_fn(3), loss_fn, batch=3)
    scaled = model_sequence("resnet50", 3)
    assert [(f.name, f.inputs, f.outputs, f.flops) for f in direct.functions] == \
        [(f.name, f.inputs, f.outputs, f.flops) for f in scaled.functions]
    assert [(v.name, v.nbytes, v.persistent) for v in direct.variables] == \
        [(v.name, v.nbytes, v.persistent) for v in scaled.variables]
