"""A page stream's scan in the simulator's GPU models: pages per second, bytes per second and
the fraction of the scan the consumer waits for a page.

One copy engine moves pages host to device one after another, each in ``copy`` seconds (the
page's bytes over the GPU's host-to-device bandwidth, :mod:`vmalloc.offload.hardware.gpus`, plus an
optional fixed latency); the consumer uses each page for ``use`` seconds. As in
:class:`~vmalloc.offload.PageStream`, page *i*'s copy is issued when the consumer asks for page
*i - prefetch* and lands in the slot page *i - prefetch - 1* left (``prefetch + 1`` slots), so::

    copy_start[i] = max(copy_end[i-1], use_end[i-prefetch-1])
    use_start[i]  = max(use_end[i-1], copy_end[i])

and the consumer waits ``use_start[i] - use_end[i-1]`` before page *i*. With ``prefetch >= 1``
a scan of ``n`` pages takes ``copy + (n-1) * max(copy, use) + use``; with ``prefetch = 0`` it
takes ``n * (copy + use)``. Every page is streamed (a scan with resident pages copies fewer).

What it leaves out: the read from disk or memory into pinned staging (the emulated device's
measured figures include it), the copy's own latency beyond ``latency``, contention between the
copy and the consumer for HBM, and the host's Python between pages.
"""

from __future__ import annotations

import dataclasses

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.hardware.gpus import get_gpu
from vmalloc.offload.pages.plan import auto_prefetch


@dataclasses.dataclass(frozen=True)
class ScanPrediction:
    """One scan of ``pages`` pages of ``page_bytes`` with ``prefetch`` pages ahead."""

    gpu: str
    page_bytes: int
    pages: int
    prefetch: int
    copy_seconds: float      # one page's host-to-device copy
    use_seconds: float       # the consumer's time on one page
    seconds: float           # the whole scan
    wait_seconds: float      # the consumer idle, waiting for a page

    @property
    def pages_per_second(self):
        return self.pages / self.seconds if self.seconds else 0.0

    @property
    def bytes_per_second(self):
        return self.pages * self.page_bytes / self.seconds if self.seconds else 0.0

    @property
    def wait_fraction(self):
        return self.wait_seconds / self.seconds if self.seconds else 0.0


def scan_seconds(pages, copy, use, prefetch):
    """(scan seconds, consumer wait seconds) for ``pages`` pages (the recurrence above)."""
    if pages < 0 or prefetch < 0 or copy < 0 or use < 0:
        raise InvalidArgumentError("pages, prefetch and times must be >= 0")
    copy_end, use_end = [], []
    wait = 0.0
    for i in range(pages):
        start = copy_end[-1] if copy_end else 0.0
        free = i - prefetch - 1     # the page whose slot this one reuses
        if free >= 0:
            start = max(start, use_end[free])
        copy_end.append(start + copy)
        last = use_end[-1] if use_end else 0.0
        begin = max(last, copy_end[-1])
        wait += begin - last
        use_end.append(begin + use)
    return (use_end[-1] if use_end else 0.0), wait


def predict_scan(gpu, page_bytes, pages, prefetch=None, use_seconds=None, latency=0.0):
    """The scan on ``gpu`` (a name of :data:`vmalloc.offload.hardware.gpus.GPUS` or a GPU).
    ``prefetch=None``: what a PageStream picks (:func:`auto_prefetch` on the GPU's link);
    ``use_seconds=None``: a kernel that reads the page once at the GPU's HBM bandwidth."""
    g = get_gpu(gpu)
    if page_bytes <= 0:
        raise InvalidArgumentError(f"page_bytes must be > 0, not {page_bytes}")
    if prefetch is None:
        prefetch = auto_prefetch(page_bytes, g.h2d_bandwidth)
    copy = latency + page_bytes / g.h2d_bandwidth
    use = page_bytes / g.hbm_bandwidth if use_seconds is None else use_seconds
    seconds, wait = scan_seconds(pages, copy, use, prefetch)
    return ScanPrediction(g.name, page_bytes, pages, prefetch, copy, use, seconds, wait)
