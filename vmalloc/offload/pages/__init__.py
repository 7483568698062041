"""Data that does not fit on the device: pages of host data (NumPy arrays, ``np.memmap``
files, or a callable making page *i*) streamed to it through the
:class:`~vmalloc.offload.SwapManager`'s pinned staging (:class:`PageStream`), with the pages
that fit a device budget kept resident and selected rows gathered into one buffer
(:meth:`PageStream.gather`). See :doc:`data`."""

from vmalloc.offload.pages.gather import GatheredRows
from vmalloc.offload.pages.plan import PrefetchWarning, auto_prefetch
from vmalloc.offload.pages.sources import PageError
from vmalloc.offload.pages.device_page import DevicePage
from vmalloc.offload.pages.stream import PageStream

__all__ = ["DevicePage", "GatheredRows", "PageError", "PageStream", "PrefetchWarning",
           "auto_prefetch"]
