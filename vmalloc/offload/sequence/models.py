"""Recorded training iterations of well-known models, shipped with vmalloc.

``model_sequence(name, batch)`` loads ``vmalloc/offload/sequence/data/<name>.json.gz`` (recorded from the
``torch.nn`` definitions in :mod:`vmalloc.offload.sequence.torch_models` by
``benchmarks/record_sequences.py``; ``resnet50-nnabla`` from nnabla's functions by
``scripts/record-nnabla-resnet50``) and scales it to ``batch``. Loading needs neither torch nor
nnabla.

=============  =====================================================  ==================
name           model                                                   one sample
=============  =====================================================  ==================
resnet50       ResNet-50 v1.5, 25,557,032 parameters                   3x224x224 image
densenet121    DenseNet-121, 7,978,856 parameters                      3x224x224 image
unet           U-Net 64..1024 channels, 2 classes, 31,037,698 params   3x512x512 image
gpt2-medium    GPT-2 medium, 354,823,168 parameters, flash attention   1024 tokens
resnet50-      the paper's workload: ResNet-50 v1.5 in nnabla (its     3x224x224 image
nnabla         functions, Momentum), recorded by vmalloc.nnabla
=============  =====================================================  ==================

Each is one iteration of float32 training: forward, cross-entropy loss, backward, and SGD with
momentum (per-parameter ops; ``resnet50-nnabla``: nnabla's solver calls, which list no arrays);
persistent variables are the parameters, BatchNorm buffers and
momentum buffers. ``seq.meta`` describes the model (``params``, ``input``, ``dtype``,
``samples_per_batch_unit``, ``recorded_with``, ...).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.sequence.sequence import FunctionSequence

__all__ = ["MODELS", "model_sequence", "data_path"]

#: Names of the shipped model sequences.
MODELS = ("resnet50", "densenet121", "unet", "gpt2-medium", "resnet50-nnabla")

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def data_path(name: str) -> str:
    """The shipped file of model ``name``."""
    _check(name)
    return os.path.join(_DATA, f"{name}.json.gz")


def _check(name):
    if not isinstance(name, str) or name not in MODELS:
        raise InvalidArgumentError(
            f"unknown model {name!r}; valid names: {', '.join(MODELS)}")


@functools.lru_cache(maxsize=None)
def _load(name):
    return FunctionSequence.load(data_path(name))


def model_sequence(name: str, batch: Optional[int] = None) -> FunctionSequence:
    """One training iteration of the shipped model ``name`` at ``batch`` samples (default:
    the batch it is stored at, 1). Returns a new sequence each call.

    Raises:
        InvalidArgumentError: an unknown name (the message lists the valid ones) or a batch
            that is not a positive int.
        SequenceFormatError: the shipped file is missing or damaged.
    """
    _check(name)
    base = _load(name)
    return base.at_batch(base.batch if batch is None else batch)
