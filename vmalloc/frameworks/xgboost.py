"""The XGBoost driver (``vmalloc.xgboost``): an ``xgboost.DataIter`` over a
:class:`vmalloc.offload.PageStream`, so that XGBoost's external-memory training
(``xgboost.ExtMemQuantileDMatrix``) reads pages vmalloc streams to the device::

    import xgboost, vmalloc, vmalloc.xgboost
    from vmalloc.offload import PageStream
    stream = PageStream(feature_pages, allocator, budget="8GiB")
    Xy = xgboost.ExtMemQuantileDMatrix(vmalloc.xgboost.pages(stream, label=label_pages))
    booster = xgboost.train({"tree_method": "hist"}, Xy)

Each batch XGBoost asks for is one page on the device: on a CUDA device an object with
``__cuda_array_interface__`` over the page's pointer (XGBoost reads it in place; train with
``device="cuda"``), on the emulated device (:class:`vmalloc.HostDevice`, whose device
addresses are host addresses) a NumPy view of it. The page's buffer is reused once the next
page is asked for, which is when XGBoost has finished with it (it copies each batch into its
own quantised pages). Labels and weights are small (one value a row): per-page host arrays.

Importing this module never needs XGBoost; using it without XGBoost raises an ImportError
that says so.
"""

from __future__ import annotations

import ctypes

from vmalloc.errors import InvalidArgumentError

__all__ = ["pages", "page_array"]

_ITER_CLASS = None


def _xgboost():
    try:
        import xgboost
    except ImportError as error:
        raise ImportError(f"vmalloc.xgboost needs XGBoost (pip install xgboost): {error}") \
            from error
    return xgboost


class _CudaArray:
    """A device page as CUDA's array interface (version 3): XGBoost, CuPy and cuDF read it."""

    def __init__(self, page, stream):
        self.__cuda_array_interface__ = {
            "shape": page.shape, "typestr": page.dtype.str, "data": (page.ptr, False),
            "version": 3, "strides": None,
            "stream": stream if isinstance(stream, int) and stream else None}


def page_array(stream, page):
    """The array XGBoost reads for ``page`` (a :class:`~vmalloc.offload.pages.DevicePage` of
    ``stream``): a NumPy view on the emulated device, after the stream's work; a CUDA array
    interface on a GPU."""
    import numpy as np

    from vmalloc._core.host_device import HostDevice
    if isinstance(stream.device, HostDevice):
        stream.device.synchronize_stream(stream.stream)
        if page.nbytes == 0:
            return np.empty(page.shape, page.dtype)
        buffer = (ctypes.c_char * page.nbytes).from_address(page.ptr)
        return np.frombuffer(buffer, dtype=page.dtype).reshape(page.shape)
    return _CudaArray(page, stream.stream)


def _check_per_page(name, values, stream):
    if values is None:
        return None
    values = list(values)
    rows = stream._source.rows
    if len(values) != len(rows):
        raise InvalidArgumentError(f"{name}: {len(values)} arrays for {len(rows)} pages")
    for i, (v, r) in enumerate(zip(values, rows)):
        if len(v) != r:
            raise InvalidArgumentError(f"{name}[{i}] has {len(v)} values, page {i} has {r} rows")
    return values


def _iter_class():
    global _ITER_CLASS
    if _ITER_CLASS is not None:
        return _ITER_CLASS
    xgboost = _xgboost()

    class PageIter(xgboost.DataIter):
        """One pass over a PageStream per XGBoost pass (``reset`` starts the next)."""

        def __init__(self, stream, label=None, weight=None, cache_prefix=None, **kwargs):
            self.stream, self.label, self.weight = stream, label, weight
            self._next = 0
            self.batches = 0
            super().__init__(cache_prefix=cache_prefix, **kwargs)

        def next(self, input_data):
            i = self._next
            if i >= len(self.stream):
                return False
            page = self.stream.page(i)
            fields = {"data": page_array(self.stream, page)}
            if self.label is not None:
                fields["label"] = self.label[i]
            if self.weight is not None:
                fields["weight"] = self.weight[i]
            input_data(**fields)
            self._next = i + 1
            self.batches += 1
            return True

        def reset(self):
            self._next = 0

    _ITER_CLASS = PageIter
    return PageIter


def pages(stream, label=None, weight=None, cache_prefix=None, **kwargs):
    """An ``xgboost.DataIter`` giving the pages of ``stream`` (a PageStream), with per-page
    host arrays ``label`` and ``weight``; ``cache_prefix`` and ``kwargs`` (``on_host``,
    ``release_data``, ``min_cache_page_bytes``) go to ``xgboost.DataIter``."""
    cls = _iter_class()
    label = _check_per_page("label", label, stream)    # before XGBoost's iterator exists
    weight = _check_per_page("weight", weight, stream)
    return cls(stream, label=label, weight=weight, cache_prefix=cache_prefix, **kwargs)
