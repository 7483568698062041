"""How a :class:`~vmalloc.offload.PageStream` spends its device budget: which pages stay
resident across passes, how many streaming slots it needs, and the prefetch depth.

A stream whose pages all fit the budget keeps them all resident (the first pass copies each
once, later passes copy nothing). Otherwise it needs ``prefetch + 1`` slots of the largest
page's size (page *i* in use while *i+1 … i+prefetch* copy), and the rest of the budget keeps
the first pages that fit resident. A budget too small for the prefetch asked lowers it (said
once: a warning, ``stats()["prefetch"]``, an exception under ``strict=True``); one smaller than
the largest page is an error.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from vmalloc.errors import InvalidArgumentError, OutOfMemoryError

#: Bytes the link should have in flight, in seconds of copying: the host-side latency a
#: prefetch hides (a disk read or a Python step between pages). A heuristic, not a measurement.
LOOKAHEAD_SECONDS = 1e-3
MAX_AUTO_PREFETCH = 8


class PrefetchWarning(UserWarning):
    """The device budget cannot hold the prefetch depth asked for: the stream uses less."""


@dataclasses.dataclass(frozen=True)
class Plan:
    resident: frozenset   # page indices kept on the device across passes
    slots: int            # streaming device buffers, each `slot_bytes`
    slot_bytes: int
    prefetch: int         # pages copied ahead of the one in use
    asked_prefetch: int

    @property
    def device_bytes(self):
        return self.slots * self.slot_bytes


def auto_prefetch(page_bytes, link_bytes_per_second):
    """Pages enough to keep the link busy for :data:`LOOKAHEAD_SECONDS` (its
    bandwidth-delay product), at least 1 and at most :data:`MAX_AUTO_PREFETCH`."""
    if not link_bytes_per_second or link_bytes_per_second <= 0 or page_bytes <= 0:
        return 2
    pages = math.ceil(LOOKAHEAD_SECONDS * link_bytes_per_second / page_bytes)
    return max(1, min(MAX_AUTO_PREFETCH, pages))


def make_plan(nbytes, budget, prefetch, strict=False):
    """The plan for pages of ``nbytes`` (a list) under ``budget`` device bytes (None: no
    limit) with ``prefetch`` pages ahead."""
    if prefetch < 0:
        raise InvalidArgumentError(f"prefetch must be >= 0, not {prefetch}")
    largest, total = max(nbytes), sum(nbytes)
    if budget is None or total <= budget:
        return Plan(frozenset(i for i, n in enumerate(nbytes) if n), 0, largest,
                    prefetch, prefetch)
    if budget < largest:
        raise OutOfMemoryError(f"device budget {budget} bytes is smaller than the largest page "
                               f"({largest} bytes): no page could be copied")
    depth = min(prefetch, budget // largest - 1, len(nbytes) - 1)
    if depth < prefetch:
        message = (f"device budget {budget} bytes holds {depth + 1} pages of {largest} bytes: "
                   f"prefetch lowered from {prefetch} to {depth}")
        if strict:
            raise OutOfMemoryError(message)
        warnings.warn(message, PrefetchWarning, stacklevel=3)   # the PageStream(...) call
    slots = depth + 1
    room = budget - slots * largest
    resident = set()
    for i, n in enumerate(nbytes):
        if n and n <= room:
            resident.add(i)
            room -= n
        elif n:
            break   # the first pages in order: a pass then streams one contiguous run
    return Plan(frozenset(resident), slots, largest, depth, prefetch)
