"""vmalloc.offload.sequence.recorder: one training iteration of a tiny module, checked op by op."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from vmalloc.errors import InvalidArgumentError  # noqa: E402
from vmalloc.offload import FunctionSequence  # noqa: E402
from vmalloc.offload.sequence.recorder import RecordingError, record  # noqa: E402


class Tiny(nn.Module):
    """(b, 2, 4) -> view (b, 8) -> Linear 8->4 (no bias) -> relu_ -> Linear 4->2 (no bias)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 4, bias=False)
        self.fc2 = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        h = torch.relu_(self.fc1(x.view(x.shape[0], 8)))
        return self.fc2(h)


def tiny_inputs(batch):
    return torch.empty(batch, 2, 4, device="meta"), torch.empty(batch, 2, device="meta")


def record_tiny(batch=3):
    with torch.device("meta"):
        model = Tiny()
    return record(model, tiny_inputs(batch), F.mse_loss, name="tiny", batch=batch)


def names(seq, ids):
    return tuple(seq.variables[i].name for i in ids)


# name of each function, variables read, variables written (by variable name)
A, O = "aten.mm.default#0:0", "aten.mm.default#2:0"
L, G = "aten.mse_loss.default#3:0", "aten.ones_like.default#4:0"
GO, GH = "aten.mse_loss_backward.default#5:0", "aten.mm.default#7:0"
GA = "aten.threshold_backward.default#8:0"
EXPECTED = [
    ("aten.mm.default", ("input0", "fc1.weight"), (A,)),       # x.view and fc1.weight.t()
    ("aten.relu_.default", (A,), (A,)),                          # in place: read + write
    ("aten.mm.default", (A, "fc2.weight"), (O,)),
    ("aten.mse_loss.default", (O, "target"), (L,)),
    ("aten.ones_like.default", (), (G,)),                        # reads only L's shape
    ("aten.mse_loss_backward.default", (G, O, "target"), (GO,)),
    # MmBackward computes the weight's gradient before the input's
    ("aten.mm.default", (GO, A), ("grad:fc2.weight",)),          # grad of fc2.weight
    ("aten.mm.default", (GO, "fc2.weight"), (GH,)),              # grad of h
    ("aten.threshold_backward.default", (GH, A), (GA,)),         # relu backward
    ("aten.mm.default", (GA, "input0"), ("grad:fc1.weight",)),   # no grad for the input
    # SGD(momentum=0.9), per parameter: buf.mul_(0.9).add_(grad); param.add_(buf, alpha=-lr)
    ("aten.mul_.Tensor", ("momentum_buffer:fc1.weight",), ("momentum_buffer:fc1.weight",)),
    ("aten.add_.Tensor", ("momentum_buffer:fc1.weight", "grad:fc1.weight"),
     ("momentum_buffer:fc1.weight",)),
    ("aten.add_.Tensor", ("fc1.weight", "momentum_buffer:fc1.weight"), ("fc1.weight",)),
    ("aten.mul_.Tensor", ("momentum_buffer:fc2.weight",), ("momentum_buffer:fc2.weight",)),
    ("aten.add_.Tensor", ("momentum_buffer:fc2.weight", "grad:fc2.weight"),
     ("momentum_buffer:fc2.weight",)),
    ("aten.add_.Tensor", ("fc2.weight", "momentum_buffer:fc2.weight"), ("fc2.weight",)),
]


def test_functions_exact():
    seq = record_tiny(3)
    got = [(f.name, names(seq, f.inputs), names(seq, f.outputs)) for f in seq.functions]
    assert got == EXPECTED
    assert seq.batch == 3 and seq.name == "tiny"


def test_variables_exact():
    seq = record_tiny(3)
    sizes = {v.name: (v.nbytes, v.persistent) for v in seq.variables}
    assert len(sizes) == len(seq.variables) == 15
    assert sizes == {
        # parameters and momentum buffers: persistent (a 4x8 float32 weight = 128 bytes)
        "fc1.weight": (128, True), "fc2.weight": (32, True),
        "momentum_buffer:fc1.weight": (128, True), "momentum_buffer:fc2.weight": (32, True),
        # inputs, activations, loss, gradients: transient (batch 3)
        "input0": (3 * 8 * 4, False), "target": (3 * 2 * 4, False),
        A: (3 * 4 * 4, False), O: (3 * 2 * 4, False), L: (4, False), G: (4, False),
        GO: (3 * 2 * 4, False), GH: (3 * 4 * 4, False), GA: (3 * 4 * 4, False),
        "grad:fc1.weight": (128, False), "grad:fc2.weight": (32, False),
    }
    assert seq.persistent_bytes() == 2 * (128 + 32)
    assert all(v.per_sample_bytes == 0 for v in seq.variables)   # fixed inputs: no scaling


def test_flops_exact():
    seq = record_tiny(3)
    flops = [f.flops for f in seq.functions]
    b = 3
    # mm (m x k) @ (k x n) = 2*m*n*k FLOPs; every other op 0
    assert flops == [2 * b * 8 * 4, 0, 2 * b * 4 * 2, 0, 0, 0,
                     2 * 2 * b * 4, 2 * b * 2 * 4, 0, 2 * 4 * b * 8] + [0] * 6
    assert seq.total_flops() == 3 * (2 * b * 32 + 2 * b * 8) - 2 * b * 32


def test_batch_scaling_matches_direct_recording():
    with torch.device("meta"):
        model = Tiny()
    scaled = record(model, tiny_inputs, F.mse_loss, name="tiny", batch=2)
    assert scaled.batch == 2 and scaled.meta["recorded_at_batches"] == [2, 4]
    by_name = {v.name: v for v in scaled.variables}
    assert by_name["input0"].per_sample_bytes == 32
    assert by_name[A].per_sample_bytes == 16
    assert by_name["fc1.weight"].per_sample_bytes == 0
    assert by_name[L].per_sample_bytes == 0
    for b in (1, 3, 7):
        direct = record_tiny(b)
        at = scaled.at_batch(b)
        assert [(f.name, f.inputs, f.outputs, f.flops) for f in at.functions] == \
            [(f.name, f.inputs, f.outputs, f.flops) for f in direct.functions]
        assert [(v.name, v.nbytes, v.persistent) for v in at.variables] == \
            [(v.name, v.nbytes, v.persistent) for v in direct.variables]


def test_batch_scaling_conv_net_matches_direct_recording():
    def net():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4),
                             nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(4, 5))

    def inputs(b):
        return (torch.empty(b, 3, 6, 6, device="meta"),
                torch.empty(b, dtype=torch.long, device="meta"))

    with torch.device("meta"):
        scaled = record(net(), inputs, F.cross_entropy, batch=2).at_batch(3)
        direct = record(net(), inputs(3), F.cross_entropy, batch=3)
    assert [(f.name, f.inputs, f.outputs, f.flops) for f in scaled.functions] == \
        [(f.name, f.inputs, f.outputs, f.flops) for f in direct.functions]
    assert [v.nbytes for v in scaled.variables] == [v.nbytes for v in direct.variables]
    conv = scaled.functions[0]
    assert conv.name == "aten.convolution.default"
    assert conv.flops == 2 * 3 * 4 * 3 * 9 * 36      # 2 * batch * cout * cin * k*k * HxW


def test_views_and_in_place_share_variables():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            y = x @ self.w              # mm
            z = y.view(2, 8)[1]         # views of y (view, select): no functions
            z.mul_(2.0)                 # in place on y's storage
            return z

    with torch.device("meta"):
        seq = record(M(), torch.empty(4, 4, device="meta"), optimizer=None)
    fs = [(f.name, f.inputs, f.outputs) for f in seq.functions[:2]]
    (mm, mm_in, (y,)), (mul, mul_in, mul_out) = fs
    # the Python scalar becomes a CPU 0-dim tensor: not a device variable
    assert (mm, mul) == ("aten.mm.default", "aten.mul_.Tensor")
    assert mul_in == mul_out == (y,)
    assert seq.variables[y].nbytes == 64
    assert not any(f.name in ("aten.t.default", "aten.view.default", "aten._unsafe_view.default",
                              "aten.detach.default", "aten.expand.default")
                   for f in seq.functions)


def test_no_optimizer_and_default_loss():
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    seq = record(model, torch.empty(5, 3), optimizer=None)   # CPU input moved to meta
    # loss = out.sum(); its gradient is an expanded (view) ones tensor; no input gradient
    assert [f.name for f in seq.functions] == [
        "aten.addmm.default", "aten.sum.default", "aten.ones_like.default",
        "aten.mm.default", "aten.sum.dim_IntList"]
    assert seq.persistent_bytes() == (3 * 2 + 2) * 4
    assert seq.batch is None and seq.name == "Linear"
    with pytest.raises(InvalidArgumentError, match="not recorded with a batch"):
        seq.at_batch(2)


def test_does_not_touch_a_real_model():
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    seq = record(model, torch.zeros(4, 3))
    assert model.weight.device.type == "cpu"
    assert torch.equal(model.weight.detach(), before)
    assert seq.persistent_bytes() == 2 * (3 * 2 + 2) * 4


def test_batch_dependent_structure_is_refused():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return torch.stack([self.lin(x[i]) for i in range(x.shape[0])])

    with torch.device("meta"), pytest.raises(RecordingError, match="differs between batch"):
        record(Loop(), lambda b: torch.empty(b, 2, device="meta"))


def test_non_linear_size_is_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            b = x.shape[0]
            torch.zeros(b + (b == 4), dtype=torch.uint8, device=x.device)  # 2 then 5 bytes
            return self.lin(x)

    with torch.device("meta"), pytest.raises(RecordingError, match="per sample"):
        record(Odd(), lambda b: torch.empty(b, 2, device="meta"))


def test_bad_arguments():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError):
        record(object(), torch.empty(1, 2))
    with pytest.raises(InvalidArgumentError):
        record(model, "not a tensor")
    with pytest.raises(InvalidArgumentError):
        record(model, lambda b: torch.empty(b, 2), batches=(4, 2))
    with pytest.raises(InvalidArgumentError):
        record(model, torch.empty(1, 2), optimizer="adam")


def test_record_roundtrips_through_a_file(tmp_path):
    seq = record_tiny(3)
    path = tmp_path / "tiny.json.gz"
    seq.save(path)
    back = FunctionSequence.load(path)
    assert back.to_dict() == seq.to_dict()


def test_package_attribute_is_the_function():
    import vmalloc.offload as off
    import vmalloc.offload.sequence.recorder  # noqa: F401  (the module has its own name)

    with torch.device("meta"):
        model = Tiny()
    seq = off.record(model, tiny_inputs(2), F.mse_loss)
    assert len(seq) == len(EXPECTED)


class Fan(nn.Module):
    """h feeds two branches (its gradient is accumulated) and a residual add (its gradient is
    shared, so eager accumulates out of place there)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = self.b(h) * self.c(h)          # two mm backwards: fresh gradients, add_ in eager
        return self.d(g) + g               # a residual: the gradient is shared, add in eager


def _adds(names):
    return sorted(n for n in names if n.split(".")[-2] in ("add", "add_")
                  or n.split("::")[-1] in ("add", "add_"))


def test_gradient_accumulation_is_recorded_as_eager_pytorch_runs_it():
    """Issue 16: under a dispatch mode autograd accumulates out of place (aten.add.Tensor);
    eager PyTorch adds in place (aten::add_) where it holds the only reference. The recorded
    backward has the adds the profiler sees in eager mode, in place and out of place."""
    from torch.profiler import profile

    torch.manual_seed(0)
    model = Fan()
    x = torch.randn(4, 8)
    with profile() as prof:
        model(x).sum().backward()
    eager = [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")]
    seq = record(model, x, optimizer=None)
    recorded = [f.name for f in seq.functions if f.name in ("aten.add.Tensor",
                                                             "aten.add_.Tensor")]
    forward_adds = 1    # the residual add of the forward pass (out of place in both)
    assert sorted(e.replace("aten::", "") for e in eager) == \
        sorted(n.split(".")[1] for n in recorded)
    assert recorded.count("aten.add_.Tensor") == eager.count("aten::add_") == 1
    assert len(recorded) == forward_adds + 2


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (GPT-2's tied embeddings)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, idx):
        return F.linear(self.ln(self.emb(idx)), self.emb.weight)


def test_tied_weight_gradient_is_accumulated_out_of_place_as_in_eager():
    """The output layer's weight gradient arrives as a view, which eager PyTorch never adds
    into in place (the view shares its storage with its base)."""
    from torch.profiler import profile

    torch.manual_seed(0)
    model = Tied()
    idx = torch.randint(0, 50, (2, 8))
    with profile() as prof:
        model(idx).sum().backward()
    eager = [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")]
    seq = record(model, idx, optimizer=None)
    recorded = [f.name for f in seq.functions if f.name.startswith("aten.add")]
    assert eager == ["aten::add"] and recorded == ["aten.add.Tensor"]
