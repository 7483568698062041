"""Where a :class:`~vmalloc.offload.PageStream`'s pages come from, and how one is read into a
pinned staging block: an in-memory NumPy array is copied (``memcpy``, GIL released); an
``np.memmap`` page is read from its file with ``os.preadv`` (GIL released), after checking that
the file still holds it (reading a mapping past a file that shrank would kill the process with
SIGBUS); a callable makes page *i*, whose result is checked, then read either way."""

from __future__ import annotations

import ctypes
import mmap
import os

from vmalloc.errors import InvalidArgumentError


class PageError(InvalidArgumentError):
    """A page that is not what the stream was promised: its index, what was expected and
    what came (wrong dtype or shape, a non-array, a file that shrank)."""


def _numpy():
    import numpy as np
    return np


class PageSource:
    """Pages ``0 .. count-1`` of one dtype and row shape (``shape[1:]``); ``nbytes[i]`` known
    before page *i* is made (a callable promises ``page_shape`` for every page)."""

    def __init__(self, pages, count=None, dtype=None, page_shape=None):
        np = _numpy()
        self._make = None
        if callable(pages) and not isinstance(pages, np.ndarray):
            if count is None or dtype is None or page_shape is None:
                raise InvalidArgumentError(
                    "a callable page source needs count=, dtype= and page_shape= (the stream "
                    "plans device memory before any page is made)")
            self._make, self._pages = pages, None
            self.count = int(count)
            self.dtype = np.dtype(dtype)
            self.page_shape = tuple(int(d) for d in page_shape)
            if not self.page_shape:
                raise InvalidArgumentError("page_shape must have at least one dimension (rows)")
            self.row_shape = self.page_shape[1:]
            self.rows = [self.page_shape[0]] * self.count
        else:
            self._pages = list(pages)
            if count is not None and count != len(self._pages):
                raise InvalidArgumentError(f"count={count} but {len(self._pages)} pages given")
            self.count = len(self._pages)
            if self.count == 0:
                raise InvalidArgumentError("a page stream needs at least one page")
            first = self._pages[0]
            if not isinstance(first, np.ndarray) or first.ndim == 0:
                raise PageError(f"page 0 is {type(first).__name__}, not a NumPy array with rows")
            self.dtype = np.dtype(dtype) if dtype is not None else first.dtype
            self.row_shape = tuple(first.shape[1:]) if page_shape is None else \
                tuple(int(d) for d in page_shape)[1:]
            self.page_shape = None
            self.rows = []
            for i, page in enumerate(self._pages):
                self._check(i, page)
                self.rows.append(page.shape[0])
        if self.count <= 0:
            raise InvalidArgumentError(f"a page stream needs at least one page, not {self.count}")
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self.nbytes = [r * self.row_bytes for r in self.rows]
        if max(self.nbytes) == 0:
            raise InvalidArgumentError("every page is empty: nothing to stream")

    def _check(self, i, page):
        np = _numpy()
        if not isinstance(page, np.ndarray):
            raise PageError(f"page {i} is {type(page).__name__}, not a NumPy array")
        if page.dtype != self.dtype:
            raise PageError(f"page {i} has dtype {page.dtype}, the stream's is {self.dtype}")
        if page.ndim == 0 or tuple(page.shape[1:]) != self.row_shape:
            raise PageError(f"page {i} has shape {page.shape}, rows of shape {self.row_shape} "
                            "expected")
        if self.page_shape is not None and tuple(page.shape) != self.page_shape:
            raise PageError(f"page {i} has shape {page.shape}, the callable promised "
                            f"{self.page_shape}")

    def page(self, i):
        """The host array of page ``i`` (made by the callable, checked)."""
        if self._make is None:
            return self._pages[i]
        page = self._make(i)
        self._check(i, page)
        return page

    def read_into(self, i, block, fill):
        """Reads page ``i`` into the pinned block at address ``block``; returns the bytes read
        from disk (0 for an in-memory page). Runs on a worker thread."""
        page = self.page(i)
        n = self.nbytes[i]
        if n == 0:
            return 0
        where = _file_extent(page)
        if where is None:
            np = _numpy()
            fill(block, np.ascontiguousarray(page))
            return 0
        path, offset = where
        target = memoryview((ctypes.c_char * n).from_address(block)).cast("B")
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size < offset + n:
                raise PageError(f"page {i}: {path} has {size} bytes, the page needs bytes "
                                f"[{offset}, {offset + n}): the file shrank")
            done = 0
            while done < n:
                got = os.preadv(f.fileno(), [target[done:]], offset + done)
                if got == 0:
                    raise PageError(f"page {i}: {path} ended at byte {offset + done} while "
                                    f"reading [{offset}, {offset + n}): the file shrank")
                done += got
        return n


def _file_extent(page):
    """(path, byte offset in the file) of a C-contiguous ``np.memmap`` page, else None: the
    page is then copied from memory."""
    np = _numpy()
    if not isinstance(page, np.memmap) or not page.flags.c_contiguous:
        return None
    if getattr(page, "mode", None) == "c":
        return None   # copy-on-write: writes to the mapping never reach the file
    mm = getattr(page, "_mmap", None)
    path = getattr(page, "filename", None)
    if not isinstance(mm, mmap.mmap) or path is None:
        return None
    # np.memmap maps from `offset` rounded down to the allocation granularity; a view keeps the
    # parent's `offset` and mapping, so its place in the file comes from its address.
    start = page.offset - page.offset % mmap.ALLOCATIONGRANULARITY
    if len(mm) == 0:
        return None
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    return os.fspath(path), start + (page.ctypes.data - base)
