"""Allocation traces: readers of PyTorch snapshots, profiler traces and RMM logs, vmalloc's own
``.vmtrace`` format, and the traces shipped with vmalloc.

Every reader yields the same thing: batches of :data:`EVENT_DTYPE` events (:data:`ALLOC`,
:data:`FREE`) that the replay engine feeds into any allocator. See docs/trace_formats.rst.
"""

from vmalloc.errors import TraceFormatError
from vmalloc.traces.builtin import builtin_traces
from vmalloc.traces.convert import convert
from vmalloc.traces.events import ALLOC, BATCH_EVENTS, EVENT_DTYPE, FREE
from vmalloc.traces.info import TraceInfo
from vmalloc.traces.reader import FORMATS, Trace, detect_format, open_trace, trace_devices
from vmalloc.traces.vmtrace import VmtraceWriter

__all__ = [
    "ALLOC",
    "BATCH_EVENTS",
    "EVENT_DTYPE",
    "FORMATS",
    "FREE",
    "Trace",
    "TraceFormatError",
    "TraceInfo",
    "VmtraceWriter",
    "builtin_traces",
    "convert",
    "detect_format",
    "open_trace",
    "trace_devices",
]
