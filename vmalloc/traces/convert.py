"""Converting any supported trace to ``.vmtrace`` or to an RMM logging CSV."""

import os

from vmalloc.errors import InvalidArgumentError
from vmalloc.traces._files import atomic_output
from vmalloc.traces.events import ALLOC
from vmalloc.traces.reader import open_trace
from vmalloc.traces.vmtrace import VmtraceWriter

#: Destination suffixes convert writes, and the format each names.
DESTINATIONS = {".vmtrace": "vmtrace", ".csv": "rmm_csv"}


class _RmmCsvWriter:
    """Writes events as RMM's LoggingResourceAdaptor does (``Thread,Time,Action,Pointer,Size,
    Stream``; thread and time are not known, so 0 and the event's index)."""

    def __init__(self, path):
        self._file = open(path, "w", encoding="utf-8", newline="")
        self._file.write("Thread,Time,Action,Pointer,Size,Stream\n")
        self._n = 0

    def write(self, batch):
        lines = []
        n = self._n
        for op, stream, addr, size in zip(batch["op"].tolist(), batch["stream"].tolist(),
                                          batch["addr"].tolist(), batch["size"].tolist()):
            action = "allocate" if op == ALLOC else "free"
            lines.append(f"0,{n},{action},{addr:#x},{size},{stream:#x}\n")
            n += 1
        self._n = n
        self._file.write("".join(lines))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def destination_format(dst):
    """The format a destination's name asks for (``"vmtrace"`` or ``"rmm_csv"``);
    InvalidArgumentError for any other name, before anything is read."""
    name = os.fspath(dst).lower()
    for suffix, fmt in DESTINATIONS.items():
        if name.endswith(suffix):
            return fmt
    raise InvalidArgumentError(
        f"cannot write {os.fspath(dst)}: convert writes .vmtrace (vmalloc's format) or .csv "
        "(an RMM log); name the destination with one of those suffixes")


def convert(src, dst, format=None, device="auto", before_window="auto", encoding="zlib"):
    """Converts the trace ``src`` to ``dst``, in the format its name asks for: ``.vmtrace``,
    or ``.csv`` for an RMM logging CSV (any other suffix is an InvalidArgumentError); returns
    the source's completed :class:`~vmalloc.traces.TraceInfo`.

    ``format``, ``device`` and ``before_window`` are as for :func:`open_trace`; ``encoding``
    (``.vmtrace`` only) is ``"zlib"`` (compact, the default) or ``"raw"``. The events written are the ones replay
    would see, so the result is marked consistent and replays without per-event work. ``dst``
    appears only once complete (written beside it, then renamed); a failure leaves no file.
    """
    src = os.fspath(src)
    dst = os.fspath(dst)
    fmt = destination_format(dst)
    if os.path.exists(dst) and os.path.exists(src) and os.path.samefile(src, dst):
        raise InvalidArgumentError(f"convert: the destination {dst} is the source")
    trace = open_trace(src, format=format, device=device, before_window=before_window)
    metadata = {
        "created_by": "vmalloc.traces.convert",
        "source": os.path.basename(src),
        "source_format": trace.format,
        "device": trace.device,
        "before_window": before_window,
    }
    with atomic_output(dst) as partial:
        writer = (_RmmCsvWriter(partial) if fmt == "rmm_csv" else
                  VmtraceWriter(partial, encoding=encoding, consistent=True, metadata=metadata))
        with writer as w:
            for batch in trace.batches():
                w.write(batch)
    return trace.info
