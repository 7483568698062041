"""Recording the iteration that :func:`vmalloc.torch.policy` plans, as ``torch.compile`` sees it.

The policy needs one training iteration recorded (:func:`vmalloc.offload.record`) and the
forward's ops keyed (:func:`forward_keys`). Both run the model on a copy whose parameters and
buffers are **FakeTensors on the meta device** (``torch._subclasses.fake_tensor.FakeTensorMode``):
shapes and dtypes only, no memory, and the recorder's rules unchanged (the fake device is meta).

Why fake and not plain meta: a forward may branch on a tensor's value. Plain meta tensors
cannot be read, so such a model could not be recorded at all. Under FakeTensorMode a model
that asks whether a tensor is a FakeTensor takes its tracing path, which is the path
``torch.compile`` compiles, since dynamo traces the region with FakeTensors too: Hugging Face
models do (transformers 5.17's ``is_tracing(tensor)`` is true for a FakeTensor, and the mask
code skips its ``attention_mask.all()`` / ``(mask[:, -1] == 0).all()`` shortcuts, building the
mask the compiled graph builds). A model that reads a value without asking (``if x.sum() >
0:``, ``Tensor.item()``, ``nonzero``) still cannot be recorded: FakeTensors have no value
either, and ``torch.compile`` would break its graph there, outside the region's plan. Those are
refused by name (:func:`refusal`), pointing to eager ``vmalloc.torch.out_of_core``. A model
that asks ``torch.compiler.is_compiling()`` instead takes its eager path here (it is false
while recording), which may differ from the compiled one: the ops that differ are said at run
time as unmatched (``stats()["unmatched_ops"]``) and saved.

Considered and not done: recording on a real device copy (``record_on="cpu"``: the iteration
run on real CPU tensors, on a deep copy). It costs the model's weights, gradients, optimizer
state and activations in host memory and a full CPU iteration, and it records what eager
PyTorch runs, not what is compiled: given a mask of ones, tiny GPT-2's eager CPU forward
reads it (one ``aten._local_scalar_dense``) and skips building the causal mask, while the
FakeTensor forward builds it (``le``, ``bitwise_and``, ``index``, ``where``) as the compiled
graph does, so a real-device recording would leave those ops unmatched.

Keyword arguments (``attention_mask=...``) reach the model through a small wrapper module
(``Keywords``, which runs no op of its own): ``example`` may be ``(kwargs_dict, target)``;
the recorder itself calls ``model(*args)``.
"""

from __future__ import annotations

import copy
from collections import Counter

from vmalloc.errors import InvalidArgumentError

__all__ = ["fake_meta_copy", "forward_keys", "record_iteration", "refusal", "split_example"]


def fake_meta_copy(model, mode):
    """A deep copy of ``model`` whose parameters and buffers are FakeTensors of ``mode`` on the
    meta device (same shapes, dtypes, ``requires_grad``; tied weights stay tied). No weight is
    copied: the copy's tensors are made first and handed to ``copy.deepcopy`` as its memo."""
    import torch
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        fake = mode.from_tensor(torch.empty_like(t, device="meta"))
        if isinstance(t, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
        memo[id(t)] = fake
    return copy.deepcopy(model, memo)


def _keywords_class():
    import torch

    class Keywords(torch.nn.Module):
        """``model(**dict(zip(names, args)))``: a positional call for the recorder, the
        model's own ops (the wrapper runs none)."""

        def __init__(self, model, names):
            super().__init__()
            self.model, self.names = model, tuple(names)

        def forward(self, *args):
            return self.model(**dict(zip(self.names, args)))
    return Keywords


def split_example(model, example):
    """-> (model to record, example as the recorder takes it, the forward's positional args).
    ``(dict, target)`` becomes keyword arguments through a ``Keywords`` wrapper."""
    from vmalloc.offload.sequence.recorder import _split_inputs
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], dict):
        kwargs, target = example
        if not all(isinstance(k, str) for k in kwargs):
            raise InvalidArgumentError("example's keyword arguments must have str names, got "
                                       f"{list(kwargs)!r}")
        args = tuple(kwargs.values())
        return _keywords_class()(model, kwargs), (args, target), args
    args, _ = _split_inputs(example)
    return model, example, args


def forward_keys(model, args):
    """(op name, occurrence) of each function the recorder records in ``model(*args)``'s
    forward, in order: the recorder's mode outside, a counting mode inside it. ``model`` is on
    the (fake) meta device already, a copy: it is put in train mode."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry
    from vmalloc.offload.sequence.recorder import _make_mode, _to_device, _Trace
    trace, keys, seen = _Trace(), [], Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, before = str(func), len(trace.ops)
            seen[name] += 1
            out = func(*args, **(kwargs or {}))
            if len(trace.ops) > before:
                keys.append((name, seen[name] - 1))
            return out
    args = _to_device(args, torch.device("meta"))
    # In train mode, as the recorder runs its copy (a model from from_pretrained is in eval
    # mode: its dropouts would not run here and the keys would not match the recording).
    model.train()
    with _make_mode(trace, "meta", flop_registry), Count():
        model(*args)
    return keys


def record_iteration(model, example, loss_fn, optimizer, batch):
    """-> (the recorded :class:`~vmalloc.offload.FunctionSequence`, the forward's keys), both
    recorded under one FakeTensorMode on fake-meta copies of ``model`` (``model`` is not
    touched). A forward that reads a tensor's value is refused (:func:`refusal`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from vmalloc.offload import record
    model, example, args = split_example(model, example)
    # Real inputs are faked as they meet the mode (their .to("meta") under it).
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            seq = record(fake_meta_copy(model, mode), example, loss_fn=loss_fn,
                         optimizer=optimizer, batch=batch)
            keys = forward_keys(fake_meta_copy(model, mode), args)
    except RuntimeError as error:
        refused = refusal(error)
        if refused is None:
            raise
        raise refused from error
    return seq, keys


def refusal(error):
    """The :class:`~vmalloc.errors.InvalidArgumentError` for ``error`` when it is a recorded
    model reading a tensor's value (naming the cause and the way out), else None."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException,
                                               UnsupportedOperatorException)
    if isinstance(error, UnsupportedOperatorException):
        return InvalidArgumentError(
            "vmalloc.torch.policy records one training iteration on FakeTensors of the meta "
            f"device (as torch.compile traces), and the model's forward runs an op they cannot "
            f"run (no fake or meta kernel): {error}. Register one (torch.library.register_fake) "
            "or train the model eagerly with vmalloc.torch.out_of_core")
    if isinstance(error, DataDependentOutputException):
        what = "reads a tensor's value (Tensor.item(), bool() or a data-dependent branch)"
    elif isinstance(error, DynamicOutputShapeException):
        what = "makes a tensor whose shape depends on values (nonzero, a boolean mask)"
    else:
        return None
    return InvalidArgumentError(
        "vmalloc.torch.policy records one training iteration on FakeTensors of the meta "
        f"device (as torch.compile traces), and the model's forward {what}, which they do not "
        f"have: {error}. torch.compile breaks its graph at such a read, so the checkpointed "
        "region could not follow a plan: train such a model eagerly with "
        "vmalloc.torch.out_of_core, or take the branch only when the tensor is not a "
        "FakeTensor (as Hugging Face's mask code does: such models are recorded)")
