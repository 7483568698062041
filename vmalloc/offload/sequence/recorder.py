"""Record one PyTorch training iteration as a :class:`~vmalloc.offload.FunctionSequence`.

:func:`record` runs forward, loss, backward and the optimizer step of a model on the **meta
device** (shapes and dtypes only: no memory, any batch) under a ``TorchDispatchMode`` that sees
every aten op:

- a *variable* is a tensor **storage** (``t.untyped_storage()``): views and in-place ops share
  their storage, so they share the variable. Its size is the storage's ``nbytes()`` (the
  largest seen, for storages that are resized). Parameters, buffers and optimizer state are
  persistent; inputs, activations, gradients and temporaries are transient (gradients are
  assumed freed by ``zero_grad(set_to_none=True)`` after the step).
- a *function* is one aten op that reads or writes storage data, and what it reads and writes
  comes from its schema: the rules of :mod:`vmalloc.offload.sequence.aten_ops`, which the
  out-of-core driver uses too (views, metadata and allocation-only ops are not functions; mutable
  arguments are written, and read unless overwritten whole; ``ones_like``-style ops do not read
  their template). ``outputs`` are the mutated arguments plus the returned storages.
- autograd's gradient accumulation is recorded as eager PyTorch runs it: in place
  (``aten.add_.Tensor``) where eager adds in place, although under the recorder's dispatch
  mode autograd adds out of place (see :func:`vmalloc.offload.sequence.aten_ops.is_accumulation`).
- FLOPs come from ``torch.utils.flop_counter.flop_registry`` (the formulas FlopCounterMode
  uses: matmuls, convolutions and their backward, attention); every other op gets ``0`` FLOPs
  and a simulator charges it by the bytes it touches.

Given ``inputs_fn(batch)`` instead of fixed inputs, the iteration is recorded at two batch sizes
(2 and 4 by default); the two recordings must have the same functions and variables, and the
difference gives each variable's ``per_sample_bytes`` and each function's ``per_sample_flops``,
so :meth:`FunctionSequence.at_batch` gives the sequence at any batch.

torch is imported when :func:`record` is called, not when this module is imported.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

from vmalloc.errors import InvalidArgumentError, VmallocError
from vmalloc.offload.sequence import aten_ops
from vmalloc.offload.sequence.sequence import FunctionSequence

__all__ = ["record", "RecordingError", "sgd"]


class RecordingError(VmallocError, RuntimeError):
    """The iteration cannot be recorded as one batch-scalable sequence (for example, the
    recordings at two batch sizes differ in their functions or variables, or a size does not
    grow linearly with the batch)."""


def sgd(params, lr=0.1, momentum=0.9, weight_decay=0.0):
    """The default optimizer factory: ``torch.optim.SGD`` with momentum, ``foreach=False`` so
    every optimizer op is per parameter."""
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                           foreach=False)


class _Trace:
    """One recorded iteration: ops with storage keys, and the storages seen."""

    def __init__(self):
        self.ops = []          # (name, in_keys, out_keys, flops)
        self.storages = {}     # key -> storage object (held so keys are never reused)
        self.sizes = {}        # key -> max nbytes seen
        self.first_name = {}   # key -> name from the op that first wrote it
        self.accumulations = {}   # op index -> (first operand key, result key)

    def fold_accumulations(self, keep):
        """Records autograd's gradient accumulations in place, as eager PyTorch runs them
        (``aten.add_``), where the recording saw them out of place (``aten.add``: any dispatch
        mode turns autograd's in-place path off). Eager adds in place when it holds the only
        reference to the first gradient: here, when no later op uses it and it is not in
        ``keep`` (a named storage). Returns {result key: first operand key}."""
        alias = {}
        last_use = {}
        for i, (_, ins, outs, _) in enumerate(self.ops):
            for k in ins + outs:
                last_use[k] = i
        for i, (name, ins, outs, flops) in enumerate(self.ops):
            ins = tuple(alias.get(k, k) for k in ins)
            outs = tuple(alias.get(k, k) for k in outs)
            acc = self.accumulations.get(i)
            if acc is not None:
                old, new = alias.get(acc[0], acc[0]), acc[1]
                if last_use.get(acc[0]) == i and old not in keep and new != old \
                        and self.sizes.get(new) == self.sizes.get(old):
                    alias[new] = old
                    last_use[old] = last_use.get(new, i)
                    name, outs = "aten.add_.Tensor", tuple(dict.fromkeys(
                        alias.get(k, k) for k in outs))
            self.ops[i] = (name, ins, outs, flops)
        return alias


def _make_mode(trace, device_type, flop_registry):
    # The class is made once: a class made per recording is a reference cycle of its own,
    # which (its method's closure holding the trace) kept every storage seen until a full
    # garbage collection.
    global _mode_class
    if _mode_class is None:
        _mode_class = _define_mode()
    return _mode_class(trace, device_type, flop_registry)


_mode_class = None


def _define_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Mode(TorchDispatchMode):
        def __init__(self, trace, device_type, flop_registry):
            super().__init__()
            self.trace, self.device_type, self.flop_registry = trace, device_type, flop_registry

        def key_of(self, t):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                return None
            if t.layout != torch.strided:
                return None
            trace = self.trace
            s = t.untyped_storage()
            k = s._cdata
            if k not in trace.storages:
                trace.storages[k] = s
                trace.sizes[k] = s.nbytes()
            else:
                n = s.nbytes()
                if n > trace.sizes[k]:
                    trace.sizes[k] = n
            return k

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            trace, key_of = self.trace, self.key_of
            # Decided before the op runs: autograd's accumulation is in place in eager mode.
            accumulation = aten_ops.is_accumulation(func, args, kwargs)
            out = func(*args, **kwargs)
            if not aten_ops.is_function(func):
                return out
            reads, writes = [], []
            for t, read, written in aten_ops.accesses(func, args, kwargs):
                k = key_of(t)
                if k is None:
                    continue
                if written:
                    writes.append(k)
                if read:
                    reads.append(k)
            read_set = set(reads)
            flat_out = tree_leaves(out)
            out_keys = []
            for t in flat_out:
                k = key_of(t)
                if k is not None:
                    out_keys.append(k)
            if not writes and all(k in read_set for k in out_keys):
                return out  # returns its input (a view the schema does not declare)
            for k in out_keys:
                if k not in writes:
                    writes.append(k)
            flops = 0
            formula = self.flop_registry.get(func._overloadpacket)
            if formula is not None:
                flops = int(formula(*args, **kwargs, out_val=out))
            name = str(func)
            index = len(trace.ops)
            for j, k in enumerate(writes):
                trace.first_name.setdefault(k, f"{name}#{index}:{j}")
            if accumulation and len(out_keys) == 1:
                trace.accumulations[index] = (key_of(args[0]), out_keys[0])
            trace.ops.append((name, tuple(dict.fromkeys(reads)), tuple(dict.fromkeys(writes)),
                              flops))
            return out

    return Mode


def _split_inputs(example):
    """``example`` -> (model args tuple, target)."""
    import torch

    if isinstance(example, torch.Tensor):
        return (example,), None
    if isinstance(example, tuple) and len(example) == 2:
        args, target = example
        if isinstance(args, torch.Tensor):
            args = (args,)
        if isinstance(args, (tuple, list)):
            return tuple(args), target
    raise InvalidArgumentError(
        "example inputs must be a tensor or a pair (model args, target), where model args is a "
        f"tensor or a tuple of tensors; got {type(example).__name__}")


def _to_device(obj, device):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(x, device) for x in obj)
    return obj


class _Session:
    """A model on the meta device with its optimizer, warmed up by one unrecorded step."""

    def __init__(self, model, loss_fn, optimizer):
        import torch

        self.device = torch.device("meta")
        on_meta = all(t.device.type == "meta" for t in
                      list(model.parameters()) + list(model.buffers()))
        if not on_meta:
            model = copy.deepcopy(model).to(self.device)
        model.train()
        self.model = model
        self.loss_fn = loss_fn
        if optimizer == "sgd":
            optimizer = sgd
        if optimizer is None:
            self.optimizer = None
        elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer = optimizer(list(model.parameters()))
        else:
            raise InvalidArgumentError(
                "optimizer must be 'sgd', None, or a factory params -> torch.optim.Optimizer "
                f"(it is created on the meta-device copy of the model), got {optimizer!r}")
        self.names = {}
        for n, p in model.named_parameters():
            self.names.setdefault(p.untyped_storage()._cdata, n)
        for n, b in model.named_buffers():
            self.names.setdefault(b.untyped_storage()._cdata, n)
        self.warm = False

    def _iteration(self, args, target):
        model = self.model
        out = model(*args)
        if self.loss_fn is None:
            loss = out.sum() if not isinstance(out, (tuple, list)) else out[0].sum()
        else:
            loss = self.loss_fn(out, target)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()

    def _persistent(self):
        import torch

        keys = {}
        keys.update(self.names)
        if self.optimizer is not None:
            pname = {id(p): self.names.get(p.untyped_storage()._cdata, "param")
                     for p in self.model.parameters()}
            for p, state in self.optimizer.state.items():
                for sname, v in state.items():
                    if isinstance(v, torch.Tensor) and v.device.type == "meta" and v.dim() > 0:
                        keys.setdefault(v.untyped_storage()._cdata,
                                        f"{sname}:{pname.get(id(p), 'param')}")
        return keys

    def _zero_grad(self):
        for p in self.model.parameters():
            p.grad = None

    def trace(self, example):
        import torch
        from torch.utils.flop_counter import flop_registry

        args, target = _split_inputs(example)
        args = _to_device(args, self.device)
        target = _to_device(target, self.device)
        if not self.warm:
            # One unrecorded step creates the optimizer state (momentum buffers), so the
            # recorded step is a steady-state one and the state is persistent.
            self._iteration(args, target)
            self._zero_grad()
            self.warm = True
        trace = _Trace()
        input_names = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                input_names.setdefault(a.untyped_storage()._cdata, f"input{i}")
        for i, t in enumerate([target] if isinstance(target, torch.Tensor) else
                              [t for t in (target or ()) if isinstance(t, torch.Tensor)]):
            input_names.setdefault(t.untyped_storage()._cdata, "target" if i == 0 else f"target{i}")
        with _make_mode(trace, "meta", flop_registry):
            self._iteration(args, target)
        persistent = self._persistent()
        alias = trace.fold_accumulations(set(persistent) | set(input_names))
        grads = {}
        for p in self.model.parameters():
            if p.grad is not None:
                k = p.grad.untyped_storage()._cdata
                grads.setdefault(alias.get(k, k),
                                 "grad:" + self.names.get(p.untyped_storage()._cdata, "param"))
        self._zero_grad()
        return trace, persistent, grads, input_names


def _build(trace, persistent, grads, input_names):
    """-> (variables [(nbytes, persistent, name)], functions [(name, ins, outs, flops)])."""
    index = {}
    variables = []

    def vid(k):
        i = index.get(k)
        if i is None:
            i = index[k] = len(variables)
            name = (persistent.get(k) or grads.get(k) or input_names.get(k)
                    or trace.first_name.get(k) or f"v{i}")
            variables.append((trace.sizes[k], k in persistent, name))
        return i

    functions = []
    for name, ins, outs, flops in trace.ops:
        functions.append((name, tuple(vid(k) for k in ins), tuple(vid(k) for k in outs), flops))
    return variables, functions


def record(model, example_inputs, loss_fn: Optional[Callable] = None, optimizer="sgd",
           name: Optional[str] = None, batch: Optional[int] = None,
           batches: Sequence[int] = (2, 4), meta: Optional[dict] = None) -> FunctionSequence:
    """Records one training iteration (forward, loss, backward, optimizer step) of ``model``.

    Args:
        model: a ``torch.nn.Module``. Its parameters and buffers are used on the meta device:
            a module already on meta is used (and trained) in place, any other is deep-copied
            to meta first. Build big models under ``with torch.device("meta"):``.
        example_inputs: a tensor (the model's one argument), a pair ``(args, target)`` (``args``
            a tensor or tuple of tensors passed as ``model(*args)``, ``target`` passed to
            ``loss_fn``), or a callable ``inputs_fn(batch)`` returning either; with a callable
            the iteration is recorded at ``batches`` and the sequence scales with the batch.
            Tensors not on meta are moved there.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``; None: ``output.sum()``.
        optimizer: ``"sgd"`` (SGD with momentum 0.9, ``foreach=False``: see :func:`sgd`), a
            factory ``params -> torch.optim.Optimizer``, or None (no step). One unrecorded
            warm-up step creates its state before recording.
        name: the sequence's name (default: the model's class name).
        batch: the batch size the sequence is expressed at. With fixed inputs it is just
            stored (None: the sequence cannot be scaled); with ``inputs_fn`` it defaults to
            ``batches[0]``.
        batches: the two batch sizes recorded with ``inputs_fn``.
        meta: extra entries for ``seq.meta``.

    Raises:
        RecordingError: the recordings at the two batch sizes differ in structure, or a
            variable's size or a function's FLOPs do not grow by a whole non-negative amount
            per sample.
        InvalidArgumentError: malformed arguments.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidArgumentError(f"loss_fn must be callable or None, got {loss_fn!r}")
    session = _Session(model, loss_fn, optimizer)
    seq_name = name or type(model).__name__
    info = {"recorded_with": f"torch {torch.__version__.split('+')[0]}",
            "optimizer": "none" if optimizer is None else
            ("SGD(momentum=0.9, foreach=False)" if optimizer == "sgd"
             else type(session.optimizer).__name__)}
    if callable(example_inputs) and not isinstance(example_inputs, torch.Tensor):
        b1, b2 = _check_batches(batches)
        if batch is None:
            batch = b1
        elif isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgumentError(f"batch must be a positive int, got {batch!r}")
        v1, f1 = _build(*session.trace(example_inputs(b1)))
        v2, f2 = _build(*session.trace(example_inputs(b2)))
        seq = _scaled(seq_name, v1, f1, v2, f2, b1, b2, batch)
        info["recorded_at_batches"] = [b1, b2]
    else:
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                                  or batch < 1):
            raise InvalidArgumentError(f"batch must be a positive int or None, got {batch!r}")
        variables, functions = _build(*session.trace(example_inputs))
        seq = FunctionSequence(seq_name, batch)
        for n, p, vname in variables:
            seq.add_variable(n, persistent=p, name=vname)
        for fname, ins, outs, flops in functions:
            seq.add_function(ins, outs, flops=flops, name=fname)
    seq.meta.update(info)
    if meta:
        seq.meta.update(meta)
    return seq


def _check_batches(batches):
    try:
        b1, b2 = batches
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"batches must be two batch sizes, got {batches!r}") from None
    for b in (b1, b2):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InvalidArgumentError(f"batches must be positive ints, got {batches!r}")
    if b1 >= b2:
        raise InvalidArgumentError(f"batches must be increasing, got {batches!r}")
    return b1, b2


def _scaled(name, v1, f1, v2, f2, b1, b2, batch):
    if len(f1) != len(f2) or len(v1) != len(v2):
        raise RecordingError(
            f"{name}: the iteration differs between batch {b1} and batch {b2} "
            f"({len(f1)} vs {len(f2)} functions, {len(v1)} vs {len(v2)} variables); it cannot "
            "be scaled with the batch (record it at one batch with fixed inputs instead)")
    for i, (a, b) in enumerate(zip(f1, f2)):
        if a[:3] != b[:3]:
            raise RecordingError(
                f"{name}: function {i} differs between batch {b1} and batch {b2}: "
                f"{a[0]} {a[1]}->{a[2]} vs {b[0]} {b[1]}->{b[2]}")
    db = b2 - b1
    seq = FunctionSequence(name, batch)
    for i, ((n1, p1, name1), (n2, p2, _)) in enumerate(zip(v1, v2)):
        if p1 != p2:
            raise RecordingError(f"{name}: variable {i} ({name1}) is persistent at one batch "
                                 "and transient at the other")
        ps, rem = divmod(n2 - n1, db)
        if rem or ps < 0:
            raise RecordingError(
                f"{name}: variable {i} ({name1}) has {n1} bytes at batch {b1} and {n2} at batch "
                f"{b2}: not a whole non-negative number of bytes per sample")
        if p1 and ps:
            raise RecordingError(f"{name}: persistent variable {i} ({name1}) grows with the "
                                 "batch")
        n = n1 + ps * (batch - b1)
        if n < 0:
            raise RecordingError(f"{name}: variable {i} ({name1}) would have {n} bytes at "
                                 f"batch {batch}")
        seq.add_variable(n, persistent=p1, name=name1, per_sample_bytes=ps)
    for i, (a, b) in enumerate(zip(f1, f2)):
        fl1, fl2 = a[3], b[3]
        if fl2 < fl1:
            raise RecordingError(f"{name}: function {i} ({a[0]}) has fewer FLOPs at batch {b2} "
                                 f"than at batch {b1}")
        psf = (fl2 - fl1) / db
        flops = fl1 + psf * (batch - b1)
        if flops < 0:
            raise RecordingError(f"{name}: function {i} ({a[0]}) would have {flops} FLOPs at "
                                 f"batch {batch}")
        seq.add_function(a[1], a[2], flops=flops, name=a[0], per_sample_flops=psf)
    return seq
