"""Real training on the emulated device, every tensor in vmalloc memory, run by the runtime.

Two small networks with hand-written backward passes and SGD with momentum, in NumPy: an MLP
and a CNN (3×3 convolutions by im2col). Each tensor — parameters, momentum, the input batch,
activations, gradients — is a :class:`~vmalloc.offload.runtime.Buffer` of a
:class:`~vmalloc.offload.Runtime`, and NumPy works on arrays that *view device memory*
(on a backed :class:`vmalloc.HostDevice`, device addresses are host addresses). A buffer is
only touched inside a ``rt.function`` that lists it: a swapped-out buffer is unmapped, and
touching it would fault as it would on a GPU.

:func:`train` runs either network for some steps and returns the losses and the final weights,
so an out-of-core run can be compared bit for bit with an in-core one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import List

import numpy as np

F32 = np.float32


def view(ptrs, buf, shape, dtype=F32):
    """A NumPy array over ``buf``'s device memory (valid inside the function only)."""
    raw = (ctypes.c_char * buf.nbytes).from_address(ptrs[buf])
    return np.ndarray(shape, dtype, buffer=raw)


def _nbytes(shape, dtype=F32):
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


class _Net:
    """Parameters and momentum as persistent buffers, helpers for transient ones."""

    def __init__(self, rt, seed):
        self.rt = rt
        self.rng = np.random.default_rng(seed)
        self.params = []   # (buffer, momentum buffer, shape)
        self.shapes = {}

    def param(self, shape, scale):
        rt = self.rt
        w = rt.allocate(_nbytes(shape), dtype=F32)
        m = rt.allocate(_nbytes(shape), dtype=F32)
        init = (self.rng.standard_normal(shape) * scale).astype(F32)
        with rt.function(writes=[w, m], name="init") as p:
            view(p, w, shape)[...] = init
            view(p, m, shape)[...] = 0
        self.params.append((w, m, shape))
        self.shapes[w.id] = shape
        return w

    def tensor(self, shape, kind="activation"):
        """A transient float32 buffer; an activation (compressible under ``compress``) unless
        ``kind`` says otherwise (weight gradients: the optimizer step reads them)."""
        buf = self.rt.allocate(_nbytes(shape), dtype=F32, kind=kind)
        self.shapes[buf.id] = shape
        return buf

    def free(self, *bufs):
        for b in bufs:
            self.rt.deallocate(b)

    def sgd(self, grads, lr, momentum):
        """One function per parameter: v = momentum*v + g; w -= lr*v."""
        rt = self.rt
        for (w, m, shape), g in zip(self.params, grads):
            with rt.function(reads=[w, m, g], writes=[w, m], name="sgd") as p:
                vv = view(p, m, shape)
                vv *= F32(momentum)
                vv += view(p, g, shape)
                view(p, w, shape)[...] -= F32(lr) * vv
            self.free(g)

    def weights(self):
        """The parameters' bytes (read through the runtime)."""
        out = []
        for w, _, shape in self.params:
            with self.rt.function(reads=[w], name="read") as p:
                out.append(view(p, w, shape).tobytes())
        return out


def _softmax_xent(rt, net, logits, labels, batch, classes):
    """Loss and d(loss)/d(logits) in one function."""
    dlogits = net.tensor((batch, classes))
    with rt.function(reads=[logits, labels], writes=[dlogits], name="softmax_xent") as p:
        z = view(p, logits, (batch, classes))
        y = view(p, labels, (batch,), np.int64)
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        s = e / e.sum(axis=1, keepdims=True)
        loss = float(-np.log(s[np.arange(batch), y] + F32(1e-12)).mean())
        d = view(p, dlogits, (batch, classes))
        d[...] = s
        d[np.arange(batch), y] -= 1
        d /= F32(batch)
    return loss, dlogits


class MLP(_Net):
    """Linear → ReLU → … → Linear, softmax cross entropy."""

    def __init__(self, rt, sizes=(1024, 1024, 1024, 10), seed=0):
        super().__init__(rt, seed)
        self.sizes = sizes
        self.weights_ = [self.param((a, b), (2.0 / a) ** 0.5)
                         for a, b in zip(sizes[:-1], sizes[1:])]

    def step(self, x_host, y_host, lr, momentum):
        rt, sizes, batch = self.rt, self.sizes, x_host.shape[0]
        x = self.tensor((batch, sizes[0]), kind="input")
        y = rt.allocate(batch * 8, dtype=np.int64)   # int64 labels
        with rt.function(writes=[x, y], name="load") as p:
            view(p, x, (batch, sizes[0]))[...] = x_host
            view(p, y, (batch,), np.int64)[...] = y_host
        acts = [x]     # inputs of each layer
        pre = []       # pre-activations (for ReLU backward)
        h = x
        for l, w in enumerate(self.weights_):
            a, b = sizes[l], sizes[l + 1]
            z = self.tensor((batch, b))

            # Forward functions are given to rt.call: the runtime may re-run them to
            # recompute what they wrote (Runtime(recompute=True)); loop values are bound now.
            def linear(p, h=h, w=w, z=z, a=a, b=b):
                np.matmul(view(p, h, (batch, a)), view(p, w, (a, b)), out=view(p, z, (batch, b)))
            rt.call(linear, reads=[h, w], writes=[z], name=f"linear{l}")
            if l == len(self.weights_) - 1:
                logits = z
                break
            r = self.tensor((batch, b))

            def relu(p, z=z, r=r, b=b):
                np.maximum(view(p, z, (batch, b)), 0, out=view(p, r, (batch, b)))
            rt.call(relu, reads=[z], writes=[r], name=f"relu{l}")
            pre.append(z)
            acts.append(r)
            h = r
        loss, dz = _softmax_xent(rt, self, logits, y, batch, sizes[-1])
        self.free(logits, y)
        grads = [None] * len(self.weights_)
        for l in range(len(self.weights_) - 1, -1, -1):
            a, b = sizes[l], sizes[l + 1]
            w, inp = self.weights_[l], acts[l]
            gw = self.tensor((a, b), kind="gradient")
            with rt.function(reads=[inp, dz], writes=[gw], name=f"linear{l}_grad_w") as p:
                np.matmul(view(p, inp, (batch, a)).T, view(p, dz, (batch, b)),
                          out=view(p, gw, (a, b)))
            grads[l] = gw
            if l == 0:
                self.free(dz, inp)
                break
            dh = self.tensor((batch, a))
            with rt.function(reads=[dz, w], writes=[dh], name=f"linear{l}_grad_x") as p:
                np.matmul(view(p, dz, (batch, b)), view(p, w, (a, b)).T,
                          out=view(p, dh, (batch, a)))
            self.free(dz, inp)
            zprev = pre[l - 1]
            dzprev = self.tensor((batch, a))
            with rt.function(reads=[dh, zprev], writes=[dzprev], name=f"relu{l - 1}_grad") as p:
                g = view(p, dzprev, (batch, a))
                g[...] = view(p, dh, (batch, a))
                g[view(p, zprev, (batch, a)) <= 0] = 0
            self.free(dh, zprev)
            dz = dzprev
        self.sgd(grads, lr, momentum)
        return loss


class CNN(_Net):
    """conv3×3 → ReLU → conv3×3 → ReLU → global average pool → linear, by im2col."""

    def __init__(self, rt, channels=(3, 16, 32), size=16, classes=10, seed=0):
        super().__init__(rt, seed)
        self.channels, self.size, self.classes = channels, size, classes
        self.convs = [self.param((c * 9, f), (2.0 / (c * 9)) ** 0.5)
                      for c, f in zip(channels[:-1], channels[1:])]
        self.fc = self.param((channels[-1], classes), (1.0 / channels[-1]) ** 0.5)

    @staticmethod
    def _im2col(x):
        b, h, w, c = x.shape
        p = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        cols = [p[:, i:i + h, j:j + w, :] for i in range(3) for j in range(3)]
        return np.concatenate(cols, axis=3).reshape(b * h * w, 9 * c)

    @staticmethod
    def _col2im(dcol, shape):
        b, h, w, c = shape
        d = dcol.reshape(b, h, w, 9, c)
        out = np.zeros((b, h + 2, w + 2, c), F32)
        k = 0
        for i in range(3):
            for j in range(3):
                out[:, i:i + h, j:j + w, :] += d[:, :, :, k, :]
                k += 1
        return out[:, 1:-1, 1:-1, :]

    def step(self, x_host, y_host, lr, momentum):
        rt, s, ch, batch = self.rt, self.size, self.channels, x_host.shape[0]
        x = self.tensor((batch, s, s, ch[0]), kind="input")
        y = rt.allocate(batch * 8, dtype=np.int64)
        with rt.function(writes=[x, y], name="load") as p:
            view(p, x, (batch, s, s, ch[0]))[...] = x_host
            view(p, y, (batch,), np.int64)[...] = y_host
        cols, pres, h = [], [], x
        for l, w in enumerate(self.convs):
            c, f = ch[l], ch[l + 1]
            # Each tensor is allocated just before the function that writes it, as a
            # framework's op allocates its output.
            col = self.tensor((batch * s * s, 9 * c))

            # rt.call: recomputable (see MLP.step); loop values bound now.
            def im2col(p, h=h, col=col, c=c):
                view(p, col, (batch * s * s, 9 * c))[...] = self._im2col(
                    view(p, h, (batch, s, s, c)))
            rt.call(im2col, reads=[h], writes=[col], name=f"im2col{l}")
            z = self.tensor((batch, s, s, f))

            def conv(p, col=col, w=w, z=z, c=c, f=f):
                np.matmul(view(p, col, (batch * s * s, 9 * c)), view(p, w, (9 * c, f)),
                          out=view(p, z, (batch * s * s, f)))
            rt.call(conv, reads=[col, w], writes=[z], name=f"conv{l}")
            r = self.tensor((batch, s, s, f))

            def relu(p, z=z, r=r, f=f):
                np.maximum(view(p, z, (batch, s, s, f)), 0, out=view(p, r, (batch, s, s, f)))
            rt.call(relu, reads=[z], writes=[r], name=f"relu{l}")
            if h is not x:
                self.free(h)
            cols.append(col)
            pres.append(z)
            h = r
        f = ch[-1]
        pooled = self.tensor((batch, f))
        with rt.function(reads=[h], writes=[pooled], name="pool") as p:
            view(p, pooled, (batch, f))[...] = view(p, h, (batch, s, s, f)).mean(axis=(1, 2))
        self.free(h)
        logits = self.tensor((batch, self.classes))
        with rt.function(reads=[pooled, self.fc], writes=[logits], name="fc") as p:
            np.matmul(view(p, pooled, (batch, f)), view(p, self.fc, (f, self.classes)),
                      out=view(p, logits, (batch, self.classes)))
        loss, dlogits = _softmax_xent(rt, self, logits, y, batch, self.classes)
        self.free(logits, y)
        gfc = self.tensor((f, self.classes), kind="gradient")
        dpool = self.tensor((batch, f))
        with rt.function(reads=[pooled, dlogits, self.fc], writes=[gfc, dpool],
                         name="fc_grad") as p:
            dl = view(p, dlogits, (batch, self.classes))
            np.matmul(view(p, pooled, (batch, f)).T, dl, out=view(p, gfc, (f, self.classes)))
            np.matmul(dl, view(p, self.fc, (f, self.classes)).T, out=view(p, dpool, (batch, f)))
        self.free(pooled, dlogits)
        grads = [None] * len(self.convs)
        dr = dpool
        first = True
        for l in range(len(self.convs) - 1, -1, -1):
            c, f = ch[l], ch[l + 1]
            z, col, w = pres[l], cols[l], self.convs[l]
            dz = self.tensor((batch, s, s, f))
            with rt.function(reads=[dr, z], writes=[dz], name=f"relu{l}_grad") as p:
                g = view(p, dz, (batch, s, s, f))
                if first:   # through the average pool
                    g[...] = (view(p, dr, (batch, f)) / F32(s * s))[:, None, None, :]
                else:
                    g[...] = view(p, dr, (batch, s, s, f))
                g[view(p, z, (batch, s, s, f)) <= 0] = 0
            first = False
            self.free(dr, z)
            gw = self.tensor((9 * c, f), kind="gradient")
            with rt.function(reads=[col, dz], writes=[gw], name=f"conv{l}_grad_w") as p:
                np.matmul(view(p, col, (batch * s * s, 9 * c)).T,
                          view(p, dz, (batch * s * s, f)), out=view(p, gw, (9 * c, f)))
            grads[l] = gw
            if l > 0:
                dx = self.tensor((batch, s, s, c))
                with rt.function(reads=[dz, w], writes=[dx], name=f"conv{l}_grad_x") as p:
                    dcol = view(p, dz, (batch * s * s, f)) @ view(p, w, (9 * c, f)).T
                    view(p, dx, (batch, s, s, c))[...] = self._col2im(dcol, (batch, s, s, c))
                dr = dx
            self.free(dz, col)
        self.free(x)
        self.sgd(grads + [gfc], lr, momentum)
        return loss


@dataclass
class TrainResult:
    losses: List[float]
    weights: List[bytes]
    stats: dict = field(default_factory=dict)


def make_data(network, batch, steps, seed=1, **net_args):
    """Deterministic inputs and labels for ``steps`` steps."""
    rng = np.random.default_rng(seed)
    if network == "mlp":
        d = (net_args.get("sizes") or (1024,))[0]
        xs = rng.standard_normal((steps, batch, d)).astype(F32)
        classes = (net_args.get("sizes") or (1024, 10))[-1]
    else:
        s = net_args.get("size", 16)
        c = (net_args.get("channels") or (3,))[0]
        xs = rng.standard_normal((steps, batch, s, s, c)).astype(F32)
        classes = net_args.get("classes", 10)
    # A learnable rule, so that the losses fall: the class is where the first ``classes``
    # inputs (channel 0 of the first pixels, for the CNN) peak.
    flat = xs.reshape(steps, batch, -1)
    ys = flat[:, :, :classes].argmax(axis=2).astype(np.int64)
    return xs, ys


def train(rt, network="mlp", batch=64, steps=4, lr=0.05, momentum=0.9, seed=0,
          batches=None, **net_args) -> TrainResult:
    """Builds ``network`` ("mlp" or "cnn") in ``rt``'s memory and trains it for ``steps``
    iterations. ``batches`` may give the batch size per step (a last, smaller batch)."""
    net = (MLP if network == "mlp" else CNN)(rt, seed=seed, **net_args)
    batches = list(batches) if batches is not None else [batch] * steps
    xs, ys = make_data(network, max(batches), len(batches), **net_args)
    losses = []
    for i, b in enumerate(batches):
        with rt.iteration():
            losses.append(net.step(xs[i, :b], ys[i, :b], lr, momentum))
    return TrainResult(losses, net.weights(), rt.stats())


#: The configurations ``vmalloc offload train`` and the example run.
CONFIGS = {
    "mlp": dict(network="mlp", batch=4096, sizes=(1024, 1024, 1024, 10), lr=0.01),
    "cnn": dict(network="cnn", batch=32, channels=(3, 16, 16, 16, 16, 16, 32), size=16,
                lr=0.01),
}


#: The most steps :func:`compare` runs: the data of every step is made up front (16 MiB a
#: step for the MLP), and 10**20 steps ended in an OverflowError traceback.
MAX_STEPS = 1000


def compare(network="mlp", steps=4, fraction=0.5, allocator="virtual", recompute=False,
            compress=None) -> dict:
    """Trains ``network`` in core, then out of core on a device of ``fraction`` of the in-core
    peak (rounded down to 2 MiB), recomputing instead of swapping where that moves fewer bytes
    if ``recompute``; returns both runs' losses, whether losses and weights are bit-identical,
    the runtime's statistics and the seconds each run took. ``compress`` (``"fp16"``,
    ``"bf16"``): the out-of-core run swaps float32 activations compressed (then not
    bit-identical: ``deviation`` says by how much)."""
    import math
    import time

    import vmalloc
    from vmalloc import allocator_kinds
    from vmalloc.errors import InvalidArgumentError
    from vmalloc.offload.runtime import Runtime

    if network not in CONFIGS:
        raise ValueError(f"network must be one of {', '.join(CONFIGS)}, got {network!r}")
    if not 2 <= steps <= MAX_STEPS:
        raise InvalidArgumentError(f"steps must be 2 to {MAX_STEPS:,}, got {steps}")
    if not 0 < fraction <= 1:
        raise InvalidArgumentError(f"fraction must be in (0, 1], got {fraction}")
    kind = allocator_kinds.get(allocator)  # InvalidArgumentError naming the kinds
    config = CONFIGS[network]

    def make(capacity, scheduler, recompute=False, compress=None):
        dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
        # 2 MiB chunks for the virtual kinds: the small networks' tensors are a few MiB.
        alloc = kind.make(dev, **kind.applicable(chunk_size="2MiB"))
        return Runtime(alloc, scheduler=scheduler, recompute=recompute, compress=compress)

    rt_in = make("4GiB", "none")
    t0 = time.perf_counter()
    ref = train(rt_in, steps=steps, **config)
    in_seconds = time.perf_counter() - t0
    peak = rt_in.stats()["peak_device_bytes"]
    capacity = int(peak * fraction) // (2 << 20) * (2 << 20)
    if capacity <= 0:
        # A device of 0 bytes is an unlimited HostDevice: the run would have no budget at all.
        smallest = math.ceil((2 << 20) / peak * 1e4) / 1e4   # rounded up: it fits
        raise InvalidArgumentError(
            f"fraction {fraction:g} of the in-core peak ({peak:,} bytes) leaves a device of "
            f"0 bytes (capacities are whole 2 MiB units): use at least {smallest:g}")
    rt_out = make(capacity, "window", recompute, compress)
    t0 = time.perf_counter()
    out = train(rt_out, steps=steps, **config)
    out_seconds = time.perf_counter() - t0
    stats = rt_out.stats()
    stats.pop("swap", None)
    return dict(network=network, allocator=allocator, steps=steps,
                in_core_peak_bytes=peak, capacity_bytes=capacity, budget_bytes=rt_out.budget,
                in_core_losses=ref.losses, out_of_core_losses=out.losses,
                identical=out.losses == ref.losses and out.weights == ref.weights,
                deviation=deviation(ref, out), compress=compress,
                in_core_seconds=in_seconds, out_of_core_seconds=out_seconds, stats=stats)


def deviation(ref: TrainResult, run: TrainResult) -> dict:
    """How far ``run``'s losses and final weights are from ``ref``'s: the largest and mean
    absolute and relative loss differences, and the largest absolute and relative (to the
    largest reference magnitude, per parameter) final weight differences."""
    a = np.asarray(ref.losses, np.float64)
    b = np.asarray(run.losses, np.float64)
    d = np.abs(b - a)
    rel = d / np.maximum(np.abs(a), 1e-30)
    w_abs, w_rel = 0.0, 0.0
    for wa, wb in zip(ref.weights, run.weights):
        x = np.frombuffer(wa, F32).astype(np.float64)
        y = np.frombuffer(wb, F32).astype(np.float64)
        dw = float(np.abs(y - x).max()) if x.size else 0.0
        w_abs = max(w_abs, dw)
        w_rel = max(w_rel, dw / max(float(np.abs(x).max()), 1e-30))
    return dict(max_abs=float(d.max()), mean_abs=float(d.mean()), max_rel=float(rel.max()),
                mean_rel=float(rel.mean()), weight_max_abs=w_abs, weight_max_rel=w_rel)
