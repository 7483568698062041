"""What the boundaries of the steady state under pressure see
(:mod:`vmalloc.frameworks.torch_pressure`): their kinds, the tensors a boundary exposes, the
optimizer step's op boundaries, and the probation's logging proxy of the swap backend."""

from __future__ import annotations

import sys

PRE, POST, PACK, UNPACK, GRAD, STEP, OP = range(7)

_light = None


def light_mode(boundary):
    """A torch-function mode for the optimizer's step only: one boundary per call of PyTorch's
    Python API (``boundary(func)``) and nothing else (an optimizer's per-parameter loop has no
    hook of its own; the runtime swaps parameters and their state one op at a time there).

    Why a torch-function mode, not a dispatch mode: it is entered before PyTorch's
    dispatcher, once per Python call, without the dispatcher's re-entry into Python for each
    aten op. Measured on AdamW's step over GPT-2's parameters (docs/benchmarks.md): a
    dispatch mode that does nothing added 4-6 ms to a 5-7 ms step (520 aten ops), a
    torch-function mode 1.5-2 ms (889 calls, property reads included). A call is a boundary
    before its own ops, so a swap the plan puts there precedes them."""
    global _light
    if _light is None:
        from torch.overrides import TorchFunctionMode

        class _StepCalls(TorchFunctionMode):
            def __init__(self, boundary):
                super().__init__()
                self.boundary = boundary

            def __torch_function__(self, func, types, args=(), kwargs=None):
                # (a property read, ``p.grad``, reads no bytes: no boundary; SGD's step makes
                # four of them per parameter and one op)
                if getattr(func, "__name__", None) != "__get__":
                    self.boundary(func)
                return func(*args, **(kwargs or {}))
        _light = _StepCalls
    return _light(boundary)


def pre_key(module, args):
    """A module pre-hook boundary's key: the module's class (not the object: BERT makes its
    loss module anew in every forward) and its tensor arguments' shapes and dtypes. One
    function for the probation's hook and the steady state's, so their keys cannot drift."""
    Tensor = sys.modules["torch"].Tensor
    return (PRE, type(module), tuple([(a.shape, a.dtype) for a in args
                                       if isinstance(a, Tensor)]))


def tensors_of(obj):
    """The tensors a boundary exposes: a tensor, or those among a tuple's, list's or dict's
    items (a module's arguments or output; Hugging Face's outputs are dicts)."""
    Tensor = sys.modules["torch"].Tensor
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (tuple, list)):
        return []
    return [t for t in obj if isinstance(t, Tensor)]


class Logging:
    """The backend, with the swaps the runtime issues noted (the probation's proxy), and its
    waits for swap-outs (the runtime counts a storage's bytes until its copy is waited for)."""

    def __init__(self, backend, note):
        self._backend = backend
        self._note = note

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def swap_out(self, ptr, stream=0):
        key = self._backend.swap_out(ptr, stream=stream)
        self._note("out", ptr)
        return key

    def swap_in(self, key, stream=0):
        ptr = self._backend.swap_in(key, stream=stream)
        self._note("in", ptr)
        return ptr

    def wait(self, key, stream=0):
        # (a swap-out's wait: the runtime counts its bytes until then)
        out = self._backend.state(key) == "swapping_out"
        self._backend.wait(key, stream=stream)
        if out:
            self._note("wait", key)
