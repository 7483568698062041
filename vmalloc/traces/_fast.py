"""The fast path of the text readers (RMM CSV, Kineto JSON): parsing and normalization in C++
(``src/trace/rmm_csv.cpp``, ``kineto_scanner.cpp``, ``normalizer.cpp`` through ``vmalloc.traces._trace_parse``), with the Python readers as the
reference. PyTorch snapshots are read by a restricted unpickler in C++ (:func:`snapshot`) and
their records normalized by the same C++ pass.

The file is read in blocks of :data:`BLOCK` bytes (through :func:`~vmalloc.traces._files.
open_binary`, so ``.gz`` is decompressed on the fly; a thread reads a few blocks ahead), so
memory stays at a few blocks, one incomplete record and the live allocations, whatever the file
size. The device count of a profiler trace (``device="auto"``) also keeps the decoded events of
each device, up to :data:`KEEP_BYTES`, so that the device's replay need not read the file
again. The C++ parsers accept
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
import weakref
import zlib

import numpy as np

from vmalloc.errors import OutOfMemoryError, TraceFormatError
from vmalloc.traces import _normalize
from vmalloc.traces._files import open_binary
from vmalloc.traces._record_reader import RecordReaderPass
from vmalloc.traces.events import BATCH_EVENTS, EVENT_DTYPE

try:
    from vmalloc.traces import _trace_parse
except ImportError:  # a build without the extension: the Python readers alone
    _trace_parse = None

#: Bytes read from the file at a time.
BLOCK = 1 << 20
#: The most bytes of decoded memory events (32 an event, in chunks of 512 KiB) that the
#: device count of a profiler trace (``device="auto"``) keeps for the pass that follows, so
#: that the replay of the device decodes them from memory instead of reading the file again
#: (256 MiB: 8 Mi events). Beyond it they are dropped and that pass reads the file: memory
#: stays bounded whatever the file size. 0 keeps none.
KEEP_BYTES = 256 << 20
#: Passes over a file's blocks so far (device counts, scans and replays together): for tests.
file_passes = 0
_BOM = b"\xef\xbb\xbf"
_FORMATS = ("rmm_csv", "kineto")
#: Snapshot history entries normalized per call of the C++ pass (the reading thread yields
#: between).
_SNAPSHOT_CHUNK = 1 << 16


def available(reader):
    """Whether ``reader``'s passes can take the fast path."""
    index = getattr(reader, "index", None)
    if getattr(reader, "format", None) == "torch_snapshot":
        return getattr(reader, "_selection", None) is not None  # read in C++ already
    return (
        _trace_parse is not None
        and getattr(reader, "format", None) in _FORMATS
        and not os.environ.get("VMALLOC_PYTHON_READERS")
        # The C++ pass takes the device ordinal as an int64: a larger one (a hostile
        # "Device Id") is left to the Python reader.
        and (index is None or -(1 << 63) <= index < (1 << 63))
    )


def _new_pass(reader, scan):
    if reader.format == "torch_snapshot":
        return _trace_parse.Pass("records", 0, -1, scan)
    if reader.format == "kineto":
        index = -1 if reader.index is None else reader.index
        return _trace_parse.Pass("kineto", reader.device_type, index, scan)
    return _trace_parse.Pass("rmm_csv", 0, -1, scan)


#: Blocks read ahead of the parser (in a thread: reading and decompressing overlap parsing),
#: where blocks are at least :data:`_READ_AHEAD_MIN` bytes.
_READ_AHEAD = 2
_READ_AHEAD_MIN = 1 << 16


def _read_ahead(f, free, full):
    """The reading thread: fills the buffers of ``free`` and puts ``(buffer, bytes)`` on
    ``full``, ``(None, None)`` at a read error the Python reader words, ``(None, exception)``
    at any other; stops at the end of the file or at a None buffer."""
    while True:
        buffer = free.get()
        if buffer is None:
            return
        try:
            n = f.readinto(memoryview(buffer))
        except (OSError, EOFError, zlib.error):
            full.put((None, None))
            return
        except BaseException as error:  # raised by the parser's thread, as it would be there
            full.put((None, error))
            return
        full.put((buffer, n))
        if not n:
            return


def _read_blocks(f):
    """``(buffer, bytes)`` for each block of ``f``, then ``(buffer, 0)``; ``(None, None)`` at
    a read error (the Python reader words it). A buffer is reused once the next is asked."""
    if BLOCK < _READ_AHEAD_MIN:
        buffer = bytearray(BLOCK)  # one buffer, refilled: no allocation per block
        while True:
            try:
                n = f.readinto(memoryview(buffer))
            except (OSError, EOFError, zlib.error):
                yield None, None
                return
            yield buffer, n
            if not n:
                return
    free, full = queue.Queue(), queue.Queue()
    for _ in range(_READ_AHEAD + 1):
        free.put(bytearray(BLOCK))
    thread = threading.Thread(target=_read_ahead, args=(f, free, full),
                              name="vmalloc-trace-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            buffer, n = full.get()
            if buffer is None:
                if n is not None:
                    raise n
                yield None, None
                return
            yield buffer, n
            if not n:
                return
            free.put(buffer)  # parsed (the C++ side copies what it keeps)
    finally:
        free.put(None)
        thread.join()


def _blocks(path, fast):
    """Feeds ``fast`` the file's blocks; yields after each. Returns False where the C++ side
    bailed out (or reading failed: the Python reader words it)."""
    global file_passes
    file_passes += 1
    ok = True
    with open_binary(path) as f:
        blocks = _read_blocks(f)
        try:
            first = True
            for buffer, n in blocks:
                if buffer is None:  # the Python reader words it
                    ok = False
                    break
                block = memoryview(buffer)[:n]
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
        finally:
            blocks.close()
    return ok


def _run(reader, fast):
    """Feeds ``fast`` every raw record of the file; yields after each block. Leaves
    ``reader.metadata`` and ``reader.skipped`` as the Python reader's pass would."""
    if reader.format == "torch_snapshot":  # the device's records, read already
        selection = reader._selection
        for start in range(0, selection.entries, _SNAPSHOT_CHUNK):
            fast.feed_selection(selection, start, _SNAPSHOT_CHUNK)
            yield
        reader.skipped = dict(selection.skipped)
        return
    kept = _take_kept(reader)
    if kept is not None:  # the device count decoded them already
        for i in range(len(kept)):
            fast.feed_kept(kept, i)
            yield
        _reader_state(reader, fast, kept.state)
        return
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


def _reader_state(reader, fast, state=None):
    if reader.format == "rmm_csv":
        columns, failures = fast.reader_state()
        reader.metadata = {"columns": columns}
        reader.skipped = {"allocate failure": failures} if failures else {}
        return
    from vmalloc.traces.kineto import _device_label

    members, devices, out_of_order, ooms, zero_bytes, recorded = (
        fast.reader_state() if state is None else state)
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


#: The last snapshot read in C++ for its device list (``((file identity, limit), Snapshot)``),
#: taken by the reader that opens the file next, so that the command line's ``--device auto``
#: reads a snapshot once.
_snapshot = None


def snapshot(path, limit, keep=False):
    """The PyTorch memory snapshot at ``path`` read in C++ (a built ``_trace_parse.Snapshot``),
    or None where the fast path is off or leaves the file to the Python reader, which then
    gives the events or words the error: a malformed or truncated pickle, protocol 0, an entry
    the reader refuses, a read error. Raises TraceFormatError, naming the opcode and its byte
    offset, for a pickle refused outright: an opcode that loads a class or calls a function,
    a length past ``limit`` (the decompressed bytes allowed), a memo index far beyond the
    values stored, a structure past its memory bound.

    The file is read in blocks of :data:`BLOCK` bytes (``.gz`` decompressed on the fly, a
    thread reading ahead) and nothing after the pickle's STOP is read. ``keep``: the result is
    kept for the next call on the same file (which takes it)."""
    global _snapshot, file_passes
    if _trace_parse is None or os.environ.get("VMALLOC_PYTHON_READERS"):
        return None
    key = (_identity(path), limit)
    found, _snapshot = _snapshot, None
    if found is not None and key[0] is not None and found[0] == key:
        _shared_snapshots[key] = found[1]
        return found[1]
    if key[0] is not None:
        shared = _shared_snapshots.get(key)
        if shared is not None:
            return shared
    status = "more"
    file_passes += 1
    try:
        parsed = _trace_parse.Snapshot(limit)
        with open_binary(path) as f:
            blocks = _read_blocks(f)
            try:
                for buffer, n in blocks:
                    if buffer is None:  # a read error (a corrupt .gz): the Python reader words it
                        return None
                    status = parsed.feed(memoryview(buffer)[:n]) if n else parsed.finish()
                    if status != "more" or not n:
                        break
            finally:
                blocks.close()
        if status == "error":
            raise TraceFormatError(parsed.error(), path)
        if status != "done" or not parsed.build():
            return None
    except MemoryError:
        raise OutOfMemoryError(f"{path}: reading the PyTorch memory snapshot needs more memory "
                               "than this machine has") from None
    if key[0] is not None:
        _shared_snapshots[key] = parsed
        if keep:
            _snapshot = (key, parsed)
    return parsed


#: Every built snapshot still in use, by ``(file identity, limit)``: the readers of one file's
#: devices (the command line replays each) share one reading instead of one each.
_shared_snapshots = weakref.WeakValueDictionary()


def kineto_devices(path):
    """``KinetoReader.devices()`` of the file at ``path`` (``{(type, id): events}``), counted
    in C++; None where the fast path is off or bails out (the Python reader then counts, or
    words the error). Each device's decoded memory events are also kept, up to
    :data:`KEEP_BYTES` in all, for the pass that follows (:func:`_take_kept`)."""
    if _trace_parse is None or os.environ.get("VMALLOC_PYTHON_READERS"):
        return None
    global _scans, _kept
    _kept = None  # the last count's only: memory stays within KEEP_BYTES
    fast = _trace_parse.Pass("kineto", None, -1, True, KEEP_BYTES)
    blocks = _blocks(path, fast)
    while True:
        try:
            next(blocks)
        except StopIteration as stop:
            ok = stop.value
            break
    if not ok:
        return None
    scans = fast.device_scans()
    identity = _identity(path)
    _scans = None if scans is None else (identity, scans)
    kept = fast.take_kept()
    if kept is not None and identity is not None:
        _kept = (identity, kept)
    return dict(sorted(fast.reader_state()[1]))


#: The decoded memory events of the last device count, by device: ``(file identity,
#: {(type, id): Kept})``, each taken (once) by the device's next pass instead of reading
#: the file again; None where they were not kept (over :data:`KEEP_BYTES`, ...).
_kept = None


def keep_only(devices):
    """Drops the kept events of every device but ``devices`` (labels: ``"cuda:0"``,
    ``"cpu"``): those no pass will take (the device count keeps them all)."""
    global _kept
    found = _kept
    if found is None:
        return
    from vmalloc.traces.kineto import _device_label

    by_device = found[1]
    for key in [k for k in by_device if _device_label(*k) not in devices]:
        del by_device[key]
    if not by_device:
        _kept = None


def _take_kept(reader):
    """The events the device count kept for ``reader``'s device (a ``Kept``), or None (used
    once)."""
    global _kept
    found = _kept
    if found is None or reader.format != "kineto" or reader.index is None:
        return None
    identity, by_device = found
    kept = by_device.pop((reader.device_type, reader.index), None)
    if not by_device:
        _kept = None
    if kept is None or identity != _identity(reader.path):
        return None
    return kept


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
