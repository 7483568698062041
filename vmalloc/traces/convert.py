"""Converting any supported trace to ``.vmtrace``."""

import os

from vmalloc.errors import InvalidArgumentError
from vmalloc.traces.reader import open_trace
from vmalloc.traces.vmtrace import VmtraceWriter


def convert(src, dst, format=None, device="auto", before_window="auto", encoding="zlib"):
    """Converts the trace ``src`` to the ``.vmtrace`` file ``dst``; returns the source's
    completed :class:`~vmalloc.traces.TraceInfo`.

    ``format``, ``device`` and ``before_window`` are as for :func:`open_trace`; ``encoding``
    is ``"zlib"`` (compact, the default) or ``"raw"``. The events written are the ones replay
    would see, so the result is marked consistent and replays without per-event work. ``dst``
    appears only once complete (written beside it, then renamed); a failure leaves no file.
    """
    src = os.fspath(src)
    dst = os.fspath(dst)
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
    partial = dst + ".partial"
    try:
        with VmtraceWriter(partial, encoding=encoding, consistent=True, metadata=metadata) as w:
            for batch in trace.batches():
                w.write(batch)
        os.replace(partial, dst)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    return trace.info
