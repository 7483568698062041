"""The fast path of the text readers (RMM CSV, Kineto JSON): parsing and normalization in C++
(``src/trace/trace_parse.cpp`` through ``vmalloc._trace_parse``), with the Python readers as the
reference.

The file is read in blocks of :data:`BLOCK` bytes (through :func:`~vmalloc.traces._files.
open_binary`, so ``.gz`` is decompressed on the fly), so memory stays at one block, one
incomplete record and the live allocations, whatever the file size. The C++ parsers accept
only input whose meaning is certain; at anything else (a malformed record, an odd construct,
an over-long one, an I/O error, a missing device) they stop, and the Python reader reads the
file again, its first records (those the C++ side already took) skipped: the events, counters,
metadata and errors are exactly the Python reader's. ``VMALLOC_PYTHON_READERS=1`` in the
environment turns the fast path off.
"""

import itertools
import json
import os
import queue
import threading
import zlib

import numpy as np

from vmalloc.traces import _normalize
from vmalloc.traces._files import open_binary
from vmalloc.traces._record_reader import RecordReaderPass
from vmalloc.traces.events import BATCH_EVENTS, EVENT_DTYPE

try:
    from vmalloc import _trace_parse
except ImportError:  # a build without the extension: the Python readers alone
    _trace_parse = None

#: Bytes read from the file at a time.
BLOCK = 1 << 20
_BOM = b"\xef\xbb\xbf"
_FORMATS = ("rmm_csv", "kineto")


def available(reader):
    """Whether ``reader``'s passes can take the fast path."""
    return (
        _trace_parse is not None
        and getattr(reader, "format", None) in _FORMATS
        and not os.environ.get("VMALLOC_PYTHON_READERS")
    )


def _new_pass(reader, scan):
    if reader.format == "kineto":
        index = -1 if reader.index is None else reader.index
        return _trace_parse.Pass("kineto", reader.device_type, index, scan)
    return _trace_parse.Pass("rmm_csv", 0, -1, scan)


def _blocks(path, fast):
    """Feeds ``fast`` the file's blocks; yields after each. Returns False where the C++ side
    bailed out (or reading failed: the Python reader words it)."""
    ok = True
    buffer = bytearray(BLOCK)  # one buffer, refilled: no allocation per block
    view = memoryview(buffer)
    with open_binary(path) as f:
        first = True
        while True:
            try:
                n = f.readinto(view)
            except (OSError, EOFError, zlib.error):  # the Python reader words it
                ok = False
                break
            block = view[:n]
            if first:
                first = False
                if block[:3] == _BOM:
                    block = block[len(_BOM):]
                elif len(block) < len(_BOM) and _BOM.startswith(block) and len(block):
                    ok = False  # a cut BOM: let the Python reader decide
                    break
            if not len(block):
                ok = fast.finish()
                break
            if not fast.feed(block):
                ok = False
                break
            yield
    return ok


def _run(reader, fast):
    """Feeds ``fast`` every raw record of the file; yields after each block. Leaves
    ``reader.metadata`` and ``reader.skipped`` as the Python reader's pass would."""
    ok = yield from _blocks(reader.path, fast)
    if ok:
        _reader_state(reader, fast)
        return
    # The Python reader from the start; the records the C++ side took are skipped.
    records = reader.records()
    taken = fast.records
    for _ in itertools.islice(records, taken):
        pass
    while True:
        chunk = list(itertools.islice(records, BATCH_EVENTS))
        if not chunk:
            break
        fast.feed_records(np.array(chunk, dtype=EVENT_DTYPE))
        yield


def _reader_state(reader, fast):
    if reader.format == "rmm_csv":
        columns, failures = fast.reader_state()
        reader.metadata = {"columns": columns}
        reader.skipped = {"allocate failure": failures} if failures else {}
        return
    from vmalloc.traces.kineto import _device_label

    members, devices, out_of_order, ooms, zero_bytes, recorded = fast.reader_state()
    metadata = {}
    for key, value in members:
        metadata[json.loads(key)] = json.loads(value)
    metadata["memory_events_by_device"] = {
        _device_label(t, i): n for (t, i), n in sorted(devices)
    }
    metadata["memory_events_out_of_time_order"] = out_of_order
    (metadata["recorded_peak_allocated_bytes"], metadata["recorded_peak_reserved_bytes"],
     metadata["allocated_before_window_bytes"]) = recorded
    reader.metadata = metadata
    skipped = {}
    if zero_bytes:
        skipped["zero-byte memory event"] = zero_bytes
    if ooms:
        skipped["oom"] = ooms
    reader.skipped = skipped


def kineto_devices(path):
    """``KinetoReader.devices()`` of the file at ``path`` (``{(type, id): events}``), counted
    in C++; None where the fast path is off or bails out (the Python reader then counts, or
    words the error)."""
    if _trace_parse is None or os.environ.get("VMALLOC_PYTHON_READERS"):
        return None
    fast = _trace_parse.Pass("kineto", None, -1, True)
    blocks = _blocks(path, fast)
    while True:
        try:
            next(blocks)
        except StopIteration as stop:
            ok = stop.value
            break
    if not ok:
        return None
    global _scans
    scans = fast.device_scans()
    _scans = None if scans is None else (_identity(path), scans)
    return dict(sorted(fast.reader_state()[1]))


#: The per-device scans of the last device count: ``(file identity, {(type, id): (before,
#: allocated before the window)})``, taken by the live scan of the pass that follows.
_scans = None


def _identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _take_scan(reader):
    """The device count's scan for ``reader``'s device, or None (used once)."""
    global _scans
    scans = _scans
    if scans is None or reader.format != "kineto" or reader.index is None:
        return None
    identity, by_device = scans
    found = by_device.pop((reader.device_type, reader.index), None)
    if found is None or identity is None or identity != _identity(reader.path):
        return None
    if not by_device:
        _scans = None
    return found


def live_before(reader):
    """``reader.live_before()``, through the fast path when the reader does not redefine it
    (a reader may add to the scan's result through ``_live_before_rest``)."""
    if type(reader).live_before is not RecordReaderPass.live_before:
        return reader.live_before()
    scanned = _take_scan(reader)
    if scanned is not None:  # the device count scanned the device already
        before, allocated = scanned
        reader.metadata = dict(reader.metadata, allocated_before_window_bytes=allocated)
        return reader._live_before_rest(dict(before))
    fast = _new_pass(reader, scan=True)
    for _ in _run(reader, fast):
        pass
    return reader._live_before_rest(fast.before_window())


def _produce(reader, fast, live, out, stop):
    """The reading thread: puts full batches of normalized events on ``out``, then None (or
    the exception that ended the pass)."""

    def put(item):
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    batch = _normalize.BATCH_EVENTS  # one setting for both paths
    try:
        fast.live_before(live_before(reader) if live else {})
        for _ in itertools.chain((None,), _run(reader, fast)):
            while fast.pending() >= batch:
                if not put(fast.take(batch)):
                    return
        while fast.pending():
            if not put(fast.take(batch)):
                return
        put(None)
    except BaseException as error:  # handed to the consumer, raised there
        put(error)


def normalized_batches(reader, info, live):
    """:func:`~vmalloc.traces._normalize.normalized_batches` over ``reader.records()`` (with
    ``reader.live_before()`` first if ``live``), event for event and counter for counter.

    The file is read and normalized in a thread (the C++ side runs without the GIL), a few
    batches ahead of the consumer, so reading overlaps the replay."""
    fast = _new_pass(reader, scan=False)
    out = queue.Queue(maxsize=4)
    stop = threading.Event()
    thread = threading.Thread(target=_produce, args=(reader, fast, live, out, stop),
                              name="vmalloc-trace-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
    skipped, counters = fast.counters()
    for reason, count in skipped:
        info.skip(reason, count)
    for name, value in counters.items():
        setattr(info, name, value)
    info.complete = True
