"""Opening any supported trace: format detection and the :class:`Trace` every reader returns."""

import os

import numpy as np

from vmalloc.errors import InvalidArgumentError, TraceFormatError
from vmalloc.traces import _fast
from vmalloc.traces._fields import AUTO, device_name, parse_device
from vmalloc.traces._files import head
from vmalloc.traces._normalize import BEFORE_WINDOW_CHOICES, LIVE_BY_DEFAULT, normalized_batches
from vmalloc.traces.events import EVENT_DTYPE
from vmalloc.traces.info import TraceInfo
from vmalloc.traces.kineto import KinetoReader
from vmalloc.traces.rmm_csv import RmmCsvReader
from vmalloc.traces.torch_snapshot import PICKLE_MAGIC, TorchSnapshotReader, snapshot_devices
from vmalloc.traces.vmtrace import MAGIC as VMTRACE_MAGIC
from vmalloc.traces.vmtrace import VmtraceReader

_READERS = {
    "torch_snapshot": TorchSnapshotReader,
    "kineto": KinetoReader,
    "rmm_csv": RmmCsvReader,
    "vmtrace": VmtraceReader,
}

#: The format names :func:`open_trace` accepts.
FORMATS = tuple(_READERS)

_ALIASES = {
    "snapshot": "torch_snapshot",
    "torch": "torch_snapshot",
    "pickle": "torch_snapshot",
    "profiler": "kineto",
    "chrome": "kineto",
    "json": "kineto",
    "rmm": "rmm_csv",
    "csv": "rmm_csv",
}

_EXTENSIONS = (
    (".vmtrace", "vmtrace"),
    (".pickle", "torch_snapshot"),
    (".pkl", "torch_snapshot"),
    (".json", "kineto"),
    (".json.gz", "kineto"),
    (".csv", "rmm_csv"),
)


def detect_format(path):
    """The format of the trace at ``path``, from its first bytes (then its name).

    Raises :class:`vmalloc.TraceFormatError` when neither tells.
    """
    data = head(path)
    if data.startswith(VMTRACE_MAGIC):
        return "vmtrace"
    if data.startswith(PICKLE_MAGIC):
        return "torch_snapshot"
    text = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    text = text.lstrip(b" \t\r\n")
    if text[:1] in (b"{", b"["):
        return "kineto"
    first_line = text.split(b"\n", 1)[0]
    if b"Action" in first_line and b"Pointer" in first_line:
        return "rmm_csv"
    name = os.fspath(path).lower()
    for extension, fmt in _EXTENSIONS:
        if name.endswith(extension):
            return fmt
    raise TraceFormatError(
        "cannot tell the trace format from the content or the name; pass format= one of "
        + ", ".join(FORMATS),
        os.fspath(path),
    )


def _format_name(format):
    name = _ALIASES.get(format, format)
    if name not in _READERS:
        raise InvalidArgumentError(
            f"unknown trace format {format!r}: expected one of {', '.join(FORMATS)}"
        )
    return name


class Trace:
    """An opened trace: its events in batches, and what is known about it.

    Made by :func:`open_trace`. :meth:`batches` can be called any number of times; each call
    reads the file again, so memory stays constant (except for PyTorch snapshots, which are
    held whole).
    """

    def __init__(self, path, format=None, device=AUTO, before_window="auto"):
        self.path = os.fspath(path)
        if before_window not in BEFORE_WINDOW_CHOICES:
            raise InvalidArgumentError(
                f"before_window must be one of {', '.join(BEFORE_WINDOW_CHOICES)}, "
                f"got {before_window!r}"
            )
        kind, index = parse_device(device)
        #: The format name (``"torch_snapshot"``, ``"kineto"``, ``"rmm_csv"``, ``"vmtrace"``).
        self.format = detect_format(self.path) if format is None else _format_name(format)
        if before_window == "auto":
            before_window = "live" if self.format in LIVE_BY_DEFAULT else "drop"
        #: ``"drop"`` or ``"live"``: see :func:`open_trace`.
        self.before_window = before_window
        self._reader = _READERS[self.format](self.path, kind, index)
        #: The device whose events are read, as ``"cuda:N"`` or ``"cpu"`` (with ``"auto"``,
        #: the one the trace has; formats of one device say ``"cuda:0"``).
        self.device = getattr(self._reader, "device", None) or (
            "cuda:0" if kind == AUTO else device_name(kind, index))
        self._info = self._new_info()
        if self._reader.direct:
            self._info.events = self._reader.header["events"]

    def _new_info(self):
        return TraceInfo(
            path=self.path,
            format=self.format,
            device=self.device,
            before_window=self.before_window,
            metadata=dict(self._reader.metadata),
        )

    @property
    def info(self):
        """What is known about the trace, as a :class:`~vmalloc.traces.TraceInfo`: metadata,
        and the counters of the last complete pass of :meth:`batches` (``info.complete``
        tells whether one has finished)."""
        return self._info

    def batches(self):
        """Yields the events as NumPy arrays of :data:`~vmalloc.traces.EVENT_DTYPE`, at most
        :data:`~vmalloc.traces.BATCH_EVENTS` each, in trace order.

        Raises :class:`vmalloc.TraceFormatError` (naming the line or record) on bad input.
        """
        info = self._new_info()
        reader = self._reader
        if reader.direct:
            yield from reader.direct_batches(info)
        elif _fast.available(reader):  # the same events and errors, parsed in C++
            yield from _fast.normalized_batches(reader, info, self.before_window == "live")
            reader.finish(info)
        else:
            live_before = reader.live_before() if self.before_window == "live" else None
            yield from normalized_batches(reader.records(), info, live_before)
            reader.finish(info)
        self._info = info

    __iter__ = batches

    def events(self):
        """All events in one array (convenient for small traces; use :meth:`batches` for big
        ones)."""
        parts = list(self.batches())
        return np.concatenate(parts) if parts else np.zeros(0, dtype=EVENT_DTYPE)

    def scan(self):
        """Reads the whole trace once and returns the completed :attr:`info`."""
        for _ in self.batches():
            pass
        return self._info

    def __repr__(self):
        return f"<Trace {self.format} {self.path!r} device={self.device}>"


def trace_devices(path, format=None):
    """``{device: memory events}`` of a trace that holds several devices (a profiler trace:
    ``{"cpu": 91, "cuda:1": 5120}``; a snapshot: the devices with a history), or None for the
    formats of one device (RMM logs, ``.vmtrace``). Reads a profiler trace once."""
    format = detect_format(path) if format is None else _format_name(format)
    path = os.fspath(path)
    if format == "kineto":
        reader = KinetoReader.__new__(KinetoReader)
        reader.path = path
        return reader.devices()
    if format == "torch_snapshot":
        return snapshot_devices(path)
    return None


def open_trace(path, format=None, device=AUTO, before_window="auto"):
    """Opens an allocation trace for replay.

    Args:
        path: a PyTorch memory snapshot pickle, a PyTorch profiler (Kineto) JSON trace
            (``.json`` or ``.json.gz``), an RMM logging CSV, or a ``.vmtrace``.
        format: ``"torch_snapshot"``, ``"kineto"``, ``"rmm_csv"`` or ``"vmtrace"``; None
            detects it from the file's first bytes (then its name).
        device: whose events to read where the trace holds several: ``"auto"`` (the
            default: the trace's only GPU device, as in the trace of one rank of a multi-GPU
            job; an error naming the devices when it has none or several), a CUDA ordinal
            (``0``), ``"cuda:N"``, or ``"cpu"`` (profiler traces of CPU runs). RMM logs and
            ``.vmtrace`` files hold one device and ignore it. See :func:`trace_devices`.
        before_window: what to do with memory allocated before the trace's window (a
            snapshot's ring buffer dropped its allocation, or recording started late), seen
            as frees of addresses the trace never allocated: ``"drop"`` (the default) drops
            those frees and counts them in ``info.unmatched_frees``; ``"live"`` treats that
            memory as live from the start, with a synthetic ALLOC at the beginning for each
            (for snapshots also for every block in use at the dump that the history never
            mentions), counted in ``info.synthetic_allocs``.

    Returns:
        a :class:`Trace`.

    Raises:
        vmalloc.TraceFormatError: the file is not a readable trace of that format, or holds
            no events of ``device``.
        vmalloc.InvalidArgumentError: an unknown format, device or ``before_window``.
        OSError: the file cannot be opened.
    """
    return Trace(path, format=format, device=device, before_window=before_window)
