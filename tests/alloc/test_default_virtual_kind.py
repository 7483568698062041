"""The default virtual allocator kind (issue 17, item 6): its utilization and its memory-
management driver calls per repetition of a small deterministic pattern, exactly, beside the
packed placements that trade one for the other; and the pointer stability out-of-core swaps rely
on, which any new default must keep (docs/virtual_allocator.rst, "Which placement is the
default"). A change of the default changes these figures: update them with the tables of
docs/benchmarks.md ("The default virtual allocator kind")."""

import numpy as np
import pytest

import vmalloc
from vmalloc import allocator_kinds
from vmalloc.replay import stress
from vmalloc.replay import replay_once

MiB = 1 << 20


def _tiled(events, n):
    """``events`` (which free all they allocate) n times back to back, each repetition at
    addresses of its own."""
    span = int(events["addr"].max()) - int(events["addr"].min()) + 4096
    out = np.tile(events, n)
    out["addr"] += np.repeat(np.arange(n, dtype=np.uint64) * np.uint64(span), len(events))
    return out


def _figures(events, kind):
    """(utilization rounded to 3 places, memory-management calls of the first repetition,
    calls added by the second, by the third)."""
    calls = [replay_once(_tiled(events, n), kind, timeline_points=0).memory_management_calls
             for n in (1, 2, 3)]
    util = replay_once(events, kind, timeline_points=0).utilization
    return round(util, 3), calls[0], calls[1] - calls[0], calls[2] - calls[1]


PATTERNS = {
    # Out-of-core swapping: tensors of many sizes in and out of a 128 MiB window.
    "swap": stress.generate("swap", layers=24, iterations=2, window_bytes=128 * MiB),
    # Sizes that grow every step.
    "growing": stress.generate("growing", steps=8),
}

KINDS = {
    "virtual": "virtual",
    "packed, remap_slack 1/16": lambda d: vmalloc.VirtualAllocator(
        d, placement="packed", remap_slack=1 / 16),
}

# (pattern, kind) -> (utilization, calls in repetition 1, 2, 3). Zero calls once warm with
# chunk placement, at a utilization the rounding to whole chunks caps; packed placement with a
# remap slack is dense but still remaps on the swap pattern every repetition.
EXPECTED = {
    ("swap", "virtual"): (0.542, 380, 0, 0),
    ("swap", "packed, remap_slack 1/16"): (0.93, 346, 111, 111),
    ("growing", "virtual"): (0.325, 288, 0, 0),
    ("growing", "packed, remap_slack 1/16"): (0.983, 117, 6, 0),
}


@pytest.mark.parametrize("pattern,kind", list(EXPECTED))
def test_default_kind_figures(pattern, kind):
    assert _figures(PATTERNS[pattern], KINDS[kind]) == EXPECTED[pattern, kind]


def test_default_placement_keeps_pointers_across_a_swap():
    """Out-of-core swaps keep a chunk-owning allocation's address (unmap_backing /
    map_backing): both ways of building the default allocator give chunk placement."""
    dev = vmalloc.HostDevice(capacity="64MiB", granularity="2MiB")
    for allocator in (vmalloc.VirtualAllocator(dev), allocator_kinds.make("virtual", dev)):
        assert allocator.placement == "chunks"
        p = allocator.allocate(5 * MiB)
        assert allocator.owns_chunks(p)
        allocator.unmap_backing(p)  # swapped out: the address stays reserved, no chunk
        assert allocator.allocation_size(p) == 5 * MiB
        allocator.map_backing(p)    # swapped in at the same address
        assert allocator.allocation_size(p) == 5 * MiB
        allocator.deallocate(p)
        allocator.release_cached()
