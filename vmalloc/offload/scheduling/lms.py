"""IBM Large Model Support (TFLMS) on a linear function sequence.

LMS rewrites the graph by *graph distance*: a tensor whose consumer is far from its producer is
swapped out after the producer and swapped back in a few operations before the consumer. On a
linear order of functions that reads:

for each transient variable and each gap between consecutive uses ``a < b`` with
``b - a >= swapout_threshold`` where the use at ``b`` reads the variable:

- ``swap_out`` after ``f_a``;
- ``wait_swap_out`` then ``swap_in`` before ``f_s`` with ``s = max(a + 1, b - swapin_ahead)``;
- ``wait_swap_in`` before ``f_b``.

**The wait rule.** LMS has no budget: TensorFlow returns a swapped-out tensor's memory to its
allocator once the device-to-host copy completes, at a time an offline plan cannot know. The
schedule therefore waits for each swap-out at the latest point it must have completed -- just
before the same variable's swap-in is issued (``wait_swap_out`` precedes ``swap_in`` in a step).
Planned bytes are thus an upper bound; a simulator may release a completed swap-out earlier.

**Drop** (``drop=True``; the planner's default, off for the runtimes until they execute drops):
a variable whose host copy is still valid -- it came back by a swap-in and nothing wrote it
since -- is not copied out again at its next gap: it is dropped before ``f_(a+1)`` (no copy;
its memory goes at once) and swapped in as before.

Persistent variables stay resident (LMS swaps activations); transient variables are allocated at
their first use and freed after their last, as in-core. Gaps whose next use overwrites the
variable without reading it are not swapped (the variable stays allocated).
"""

from __future__ import annotations

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.scheduling.in_core import in_core_steps
from vmalloc.offload.scheduling.schedule import Schedule


def _count(value, what, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


class LMSScheduler:
    """Swap each activation across long gaps between uses (see the module docstring).

    Args:
        swapout_threshold: the least distance ``b - a`` (in functions) between two uses for the
            variable to be swapped out between them (>= 1).
        swapin_ahead: how many functions before its use ``b`` a swap-in is issued (>= 0;
            never before ``a + 1``).
    """

    name = "lms"

    def __init__(self, swapout_threshold: int = 2, swapin_ahead: int = 1, drop: bool = False):
        self.swapout_threshold = _count(swapout_threshold, "swapout_threshold", 1)
        self.swapin_ahead = _count(swapin_ahead, "swapin_ahead", 0)
        self.drop = bool(drop)

    def __repr__(self):
        return (f"LMSScheduler(swapout_threshold={self.swapout_threshold}, "
                f"swapin_ahead={self.swapin_ahead}, drop={self.drop})")

    def schedule(self, seq) -> Schedule:
        threshold, ahead = self.swapout_threshold, self.swapin_ahead
        steps, resident = in_core_steps(seq)
        functions = seq.functions
        uses = seq.uses()
        for var in seq.variables:
            v = var.id
            u = uses[v]
            if var.persistent:
                continue
            valid = False       # the host holds v's current content
            for a, b in zip(u, u[1:]):
                if v in functions[a].outputs:
                    valid = False
                if b - a >= threshold and v in functions[b].inputs:
                    s = max(a + 1, b - ahead)
                    if valid and self.drop:
                        steps[a + 1].drop.append(v)
                    else:
                        steps[a].swap_out.append(v)
                        steps[s].wait_swap_out.append(v)
                    steps[s].swap_in.append(v)
                    steps[b].wait_swap_in.append(v)
                    valid = True
        return Schedule("lms", steps, params={"swapout_threshold": threshold,
                                              "swapin_ahead": ahead, "drop": self.drop},
                        initial_resident=frozenset(resident))

    __call__ = schedule
