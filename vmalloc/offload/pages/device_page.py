"""DevicePage: one page of a :class:`~vmalloc.offload.PageStream` on the device, as the
stream serves it."""

from __future__ import annotations


class DevicePage:
    """Page ``index`` on the device: ``ptr`` (``nbytes`` bytes, C order ``shape`` of
    ``dtype``), ready for work queued on the stream's ``stream``. A streamed page's buffer is
    reused once the next page is asked for; a ``resident`` one keeps its data and pointer."""

    __slots__ = ("index", "ptr", "nbytes", "shape", "dtype", "resident", "_stream")

    def __init__(self, stream, index, ptr, resident):
        source = stream._source
        self._stream, self.index, self.ptr, self.resident = stream, index, ptr, resident
        self.nbytes = source.nbytes[index]
        self.shape = (source.rows[index],) + source.row_shape
        self.dtype = source.dtype

    def to_numpy(self):
        """A host copy of the page (reads the device, after the stream's work)."""
        import numpy as np
        data = self._stream.device.read(self.ptr, self.nbytes, stream=self._stream.stream) \
            if self.nbytes else b""
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape).copy()

    def __repr__(self):
        kind = "resident" if self.resident else "streamed"
        return f"<DevicePage {self.index} {kind} {self.shape} {self.dtype} at {self.ptr:#x}>"
