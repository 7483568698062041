"""``PageStream.gather``: selected rows of every page compacted into one device buffer (the
sampling step of Ou's out-of-core gradient boosting: a sample of the rows fits where the data
does not). Each page holding a selected row is brought to the device once, in page order,
and its rows copied device to device, runs of consecutive rows in one copy."""

from __future__ import annotations

from vmalloc.errors import InvalidArgumentError


class GatheredRows:
    """A device buffer of ``shape[0]`` rows gathered from a :class:`PageStream` (C order,
    ``dtype``), owned by the stream until :meth:`free` (or the stream's ``close``)."""

    __slots__ = ("ptr", "nbytes", "shape", "dtype", "_stream")

    def __init__(self, stream, ptr, rows):
        source = stream._source
        self._stream, self.ptr = stream, ptr
        self.shape = (rows,) + source.row_shape
        self.dtype = source.dtype
        self.nbytes = rows * source.row_bytes

    def to_numpy(self):
        """A host copy (reads the device, after the stream's work)."""
        import numpy as np
        data = self._stream.device.read(self.ptr, self.nbytes, stream=self._stream.stream)
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape).copy()

    def free(self):
        """Frees the buffer (after the stream's work); idempotent."""
        stream = self._stream
        with stream._lock:
            if stream._buffers.pop(self.ptr, None) is not None:
                stream.manager.deallocate(self.ptr, stream=stream.stream)

    def __repr__(self):
        return f"<GatheredRows {self.shape} {self.dtype} at {self.ptr:#x}>"


def _runs(src, dst):
    """(first source row, first destination row, length) of runs where both advance by 1."""
    start = 0
    for k in range(1, len(src) + 1):
        if k == len(src) or src[k] != src[k - 1] + 1 or dst[k] != dst[k - 1] + 1:
            yield int(src[start]), int(dst[start]), k - start
            start = k


def gather(stream, rows):
    import numpy as np
    try:
        rows = np.asarray(rows)
    except Exception as error:
        raise InvalidArgumentError(f"gather: rows must be integers: {error}") from None
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"gather: rows must be a 1-D array of integers, got "
                                   f"dtype {rows.dtype} shape {rows.shape}")
    offsets = np.asarray(stream.row_offsets, dtype=np.int64)
    total = int(offsets[-1])
    if rows.size == 0:
        raise InvalidArgumentError("gather: no rows selected")
    rows = rows.astype(np.int64)
    if rows.min() < 0 or rows.max() >= total:
        bad = int(rows[(rows < 0) | (rows >= total)][0])
        raise InvalidArgumentError(f"gather: row {bad} out of range(0, {total})")
    row_bytes = stream._source.row_bytes
    order = np.argsort(rows, kind="stable")
    page_of = np.searchsorted(offsets, rows[order], side="right") - 1
    ptr = stream.manager.allocate(rows.size * row_bytes, stream=stream.stream)
    stream._buffers[ptr] = True
    out = GatheredRows(stream, ptr, rows.size)
    try:
        for page in np.unique(page_of):
            picked = page_of == page
            src = rows[order][picked] - offsets[page]
            dst = order[picked]
            device_page = stream.page(int(page))
            for s, d, n in _runs(src, dst):
                stream.device.copy_device(ptr + d * row_bytes, device_page.ptr + s * row_bytes,
                                          n * row_bytes, stream=stream.stream)
        stream._counts["rows_gathered"] += int(rows.size)
    except BaseException:
        out.free()
        raise
    return out
