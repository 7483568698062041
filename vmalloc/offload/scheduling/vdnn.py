"""vDNN (Rhu et al., "vDNN: Virtualized deep neural networks", vDNN_all) on a linear sequence.

vDNN offloads every layer's feature maps during the forward pass and prefetches them back
during the backward pass, one layer ahead. On a function sequence:

- **The forward rule.** The forward pass is functions ``[0, forward_end)``. By default
  ``forward_end`` is the index of the first function whose name contains ``"backward"``
  (case-insensitive); if no name does, half the sequence (``len(seq) // 2``). Pass
  ``forward_end`` to choose it.
- every transient variable born in the forward pass (first used before ``forward_end``: layer
  outputs, and the input batch, which vDNN offloads as the first layer's input) whose first
  use at or after ``forward_end`` (its first backward use ``b``) *reads* it is swapped out after
  its last forward use ``a``; vDNN synchronizes each layer's offload before the next layer, so
  ``wait_swap_out`` comes before ``f_(a+1)``;
- it is swapped in before ``f_(b-1)`` (one function ahead; never before ``f_(a+1)``) and
  waited before ``f_b``. A variable with ``b == a + 1`` is not swapped (nothing to gain).

Persistent variables stay resident; transient variables are allocated at their first use and
freed after their last, as in-core.
"""

from __future__ import annotations

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.scheduling.in_core import in_core_steps
from vmalloc.offload.scheduling.schedule import Schedule


def forward_end_of(seq) -> int:
    """The default end of the forward pass (see the module docstring)."""
    for f in seq.functions:
        if "backward" in f.name.lower():
            return f.index
    return len(seq.functions) // 2


class VDNNScheduler:
    """vDNN_all: offload forward activations, prefetch them one function ahead in backward."""

    name = "vdnn"

    def __init__(self, forward_end=None):
        if forward_end is not None and (isinstance(forward_end, bool)
                                        or not isinstance(forward_end, int) or forward_end < 0):
            raise InvalidArgumentError(
                f"forward_end must be a non-negative int or None, got {forward_end!r}")
        self.forward_end = forward_end

    def __repr__(self):
        return f"VDNNScheduler(forward_end={self.forward_end!r})"

    def schedule(self, seq) -> Schedule:
        fe = forward_end_of(seq) if self.forward_end is None else min(self.forward_end,
                                                                       len(seq.functions))
        functions = seq.functions
        steps, resident = in_core_steps(seq)
        uses = seq.uses()
        for var in seq.variables:
            v = var.id
            u = uses[v]
            if var.persistent or not u:
                continue
            fwd = [i for i in u if i < fe]
            bwd = [i for i in u if i >= fe]
            if not fwd or not bwd:
                continue
            a, b = fwd[-1], bwd[0]
            if b - a < 2 or v not in functions[b].inputs:
                continue
            steps[a].swap_out.append(v)
            steps[a + 1].wait_swap_out.append(v)
            steps[max(a + 1, b - 1)].swap_in.append(v)
            steps[b].wait_swap_in.append(v)
        return Schedule("vdnn", steps, params={"forward_end": fe},
                        initial_resident=frozenset(resident))

    __call__ = schedule
