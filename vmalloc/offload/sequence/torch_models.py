"""``torch.nn`` definitions of the models whose recorded iterations vmalloc ships.

Written with ``torch.nn`` only (torchvision's PyPI wheels are CUDA builds that do not import on
a CPU-only torch). Each model comes with ``inputs_fn(batch)`` (returning ``(args, target)`` as
:func:`vmalloc.offload.sequence.recorder.record` takes them) and a cross-entropy loss:

=============  ==============================================================  ===========
name           model                                                            parameters
=============  ==============================================================  ===========
resnet50       ResNet-50 v1.5 (torchvision's architecture), 3x224x224, 1000      25,557,032
densenet121    DenseNet-121 (torchvision's, growth 32, bn_size 4), 3x224x224      7,978,856
unet           U-Net (Ronneberger et al., 64..1024 channels, padded 3x3          31,037,698
               convs, transposed-conv upsampling), 3x512x512, 2 classes
gpt2-medium    GPT-2 medium: 24 layers, d_model 1024, 16 heads, context 1024,   354,823,168
               vocab 50257, tied embeddings, pre-LN, GELU(tanh); attention is
               the fused flash-attention op (no S x S matrix) as on a GPU
=============  ==============================================================  ===========

``build(name)`` returns ``(model, inputs_fn, loss_fn, meta)``; build under
``with torch.device("meta"):`` to allocate nothing.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ResNet50", "DenseNet121", "UNet", "GPT", "build", "BUILDERS"]


# --- ResNet-50 v1.5 -----------------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        # v1.5: the stride is on the 3x3 convolution
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    """torchvision's ``resnet50()``: 25,557,032 parameters."""

    def __init__(self, num_classes=1000, layers=(3, 4, 6, 3)):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * 4, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --- DenseNet-121 -------------------------------------------------------------------------
class _DenseLayer(nn.Module):
    def __init__(self, num_input_features, growth_rate, bn_size):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def forward(self, features):
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers, num_input_features, bn_size, growth_rate):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}", _DenseLayer(
                num_input_features + i * growth_rate, growth_rate, bn_size))

    def forward(self, init_features):
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features, num_output_features):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, 1, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)


class DenseNet121(nn.Module):
    """torchvision's ``densenet121()`` (``memory_efficient=False``): 7,978,856 parameters."""

    def __init__(self, growth_rate=32, block_config=(6, 12, 24, 16), num_init_features=64,
                 bn_size=4, num_classes=1000):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, 7, stride=2,
                                                    padding=3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(3, stride=2, padding=1))
        n = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}",
                                     _DenseBlock(num_layers, n, bn_size, growth_rate))
            n += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(n, n // 2))
                n //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(n))
        self.classifier = nn.Linear(n, num_classes)

    def forward(self, x):
        out = F.relu(self.features(x), inplace=True)
        out = torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1)
        return self.classifier(out)


# --- U-Net --------------------------------------------------------------------------------
class _DoubleConv(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True))


class UNet(nn.Module):
    """U-Net with channels 64, 128, 256, 512, 1024, padded 3x3 convolutions with BatchNorm,
    2x2 max pooling down and 2x2 transposed convolutions up, a 1x1 classifier:
    31,037,698 parameters for 3 input channels and 2 classes."""

    def __init__(self, in_channels=3, num_classes=2, widths=(64, 128, 256, 512, 1024)):
        super().__init__()
        self.inc = _DoubleConv(in_channels, widths[0])
        self.down = nn.ModuleList(_DoubleConv(widths[i], widths[i + 1])
                                  for i in range(len(widths) - 1))
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                for i in reversed(range(len(widths) - 1)))
        self.upconv = nn.ModuleList(_DoubleConv(widths[i] * 2, widths[i])
                                    for i in reversed(range(len(widths) - 1)))
        self.outc = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x):
        x = self.inc(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(F.max_pool2d(x, 2))
        for up, conv in zip(self.up, self.upconv):
            x = conv(torch.cat([skips.pop(), up(x)], 1))
        return self.outc(x)


# --- GPT-2 medium -------------------------------------------------------------------------
def _attention(q, k, v):
    """Causal attention. On the meta device (recording), the fused flash-attention op that a
    GPU runs (it keeps only the output and the log-sum-exp for backward); elsewhere
    ``F.scaled_dot_product_attention``."""
    if q.device.type == "meta":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (y.view(shape).transpose(1, 2) for y in (q, k, v))
        y = _attention(q, k, v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2 style decoder (pre-LayerNorm, learned positions, tied input/output
    embeddings). The defaults are GPT-2 medium: 354,823,168 parameters."""

    def __init__(self, vocab_size=50257, n_ctx=1024, n_layer=24, d_model=1024, n_head=16):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(n_ctx, d_model)
        self.h = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def _lm_loss(logits, target):
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


def _image_inputs(shape, classes, per_pixel=False):
    def inputs_fn(batch):
        x = torch.empty((batch,) + shape, device="meta")
        tshape = (batch,) + shape[1:] if per_pixel else (batch,)
        return x, torch.empty(tshape, dtype=torch.long, device="meta")
    return inputs_fn


def _resnet50():
    return (ResNet50(), _image_inputs((3, 224, 224), 1000), F.cross_entropy,
            {"samples_per_batch_unit": "images", "input": "3x224x224", "classes": 1000,
             "model": "ResNet-50 v1.5 (torchvision architecture, torch.nn)"})


def _densenet121():
    return (DenseNet121(), _image_inputs((3, 224, 224), 1000), F.cross_entropy,
            {"samples_per_batch_unit": "images", "input": "3x224x224", "classes": 1000,
             "model": "DenseNet-121 (torchvision architecture, torch.nn)"})


def _unet():
    return (UNet(), _image_inputs((3, 512, 512), 2, per_pixel=True), F.cross_entropy,
            {"samples_per_batch_unit": "images", "input": "3x512x512", "classes": 2,
             "model": "U-Net 64..1024 channels, padded convs + BatchNorm, transposed-conv up"})


def _gpt2_medium():
    def inputs_fn(batch):
        idx = torch.empty((batch, 1024), dtype=torch.long, device="meta")
        return idx, torch.empty((batch, 1024), dtype=torch.long, device="meta")
    return (GPT(), inputs_fn, _lm_loss,
            {"samples_per_batch_unit": "sequences of 1024 tokens", "input": "1024 tokens",
             "vocab": 50257,
             "model": "GPT-2 medium (24 layers, d_model 1024, 16 heads, tied embeddings), "
                      "flash attention"})


BUILDERS = {
    "resnet50": _resnet50,
    "densenet121": _densenet121,
    "unet": _unet,
    "gpt2-medium": _gpt2_medium,
}


def build(name):
    """-> ``(model, inputs_fn, loss_fn, meta)`` for a shipped model name."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        from vmalloc.errors import InvalidArgumentError
        raise InvalidArgumentError(
            f"unknown model {name!r}; choose one of {', '.join(BUILDERS)}") from None
    model, inputs_fn, loss_fn, meta = builder()
    meta = dict(meta, dtype="float32",
                params=sum(p.numel() for p in model.parameters()))
    return model, inputs_fn, loss_fn, meta
