# cython: language_level=3, boundscheck=False, wraparound=False
"""The C++ fast path of the RMM CSV and Kineto JSON readers and of their normalization
(src/trace/rmm_csv.cpp, kineto_scanner.cpp, normalizer.cpp, before_window.cpp), and of the
PyTorch snapshot reader (a restricted unpickler,
src/trace/pickle_reader.cpp, and the snapshot's rules, src/trace/torch_snapshot.cpp), driven by
:mod:`vmalloc.traces._fast`."""

from libc.stdint cimport INT64_MIN, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.string_view cimport string_view
from libcpp.utility cimport pair
from libcpp.vector cimport vector

import numpy as np

from vmalloc.traces.events import EVENT_DTYPE


from vmalloc._lib.trace.pickle_reader cimport (
    PickleKind,
    PickleReader,
    PickleStatus,
    PickleValue,
    k_big_integer,
    k_big_unsigned,
    k_boolean,
    k_bytearray,
    k_bytes,
    k_dict,
    k_floating,
    k_integer,
    k_list,
    k_none,
    k_set,
    k_str,
    k_tuple,
    w_allocator_settings,
)
from vmalloc._lib.trace.replay cimport TraceEvent
from vmalloc._lib.trace.torch_snapshot cimport SnapshotDevice, SnapshotHistory
from vmalloc._lib.trace.before_window cimport BeforeWindowScanner
from vmalloc._lib.trace.kineto_scanner cimport DeviceScan, KinetoScanner
from vmalloc._lib.trace.normalizer cimport Normalizer
from vmalloc._lib.trace.rmm_csv cimport RmmCsvParser


#: Normalizer::Reason, as _normalize.py words them.
_REASONS = ("live before window, size unknown", "zero-size alloc", "alloc at address 0",
            "free of address 0")


cdef object _array(const TraceEvent* events, size_t n):
    """An EVENT_DTYPE array of ``n`` events, padding bytes zeroed."""
    out = np.empty(n, dtype=EVENT_DTYPE)
    if n == 0:
        return out
    cdef uint8_t[::1] raw = out.view(np.uint8)
    cdef uint8_t* dst = &raw[0]
    cdef size_t i
    with nogil:
        memcpy(dst, events, n * 32)
        for i in range(n):
            memset(dst + 32 * i + 1, 0, 7)
    return out


cdef str _status_name(PickleStatus status):
    if status == PickleStatus.more:
        return "more"
    if status == PickleStatus.done:
        return "done"
    if status == PickleStatus.bail:
        return "bail"
    return "error"


class _Undecided(Exception):
    """A value the conversion leaves to Python's unpickler (too deep, a tuple in a cycle)."""


cdef object _to_python(PickleReader* reader, const PickleValue& v, dict seen, int depth):
    """The Python object of a value of the pickle's tree (containers by identity, as the
    memo shared them)."""
    cdef PickleKind kind = v.kind
    cdef double d
    cdef string_view b
    cdef vector[PickleValue] items
    cdef size_t i
    if depth > 100:
        raise _Undecided()
    if kind == k_none:
        return None
    if kind == k_boolean:
        return v.v != 0
    if kind == k_integer:
        return <int64_t>v.v
    if kind == k_big_unsigned:
        return v.v
    if kind == k_floating:
        memcpy(&d, &v.v, 8)
        return d
    if kind == k_str or kind == k_bytes or kind == k_bytearray or kind == k_big_integer:
        b = reader.blob(v)
        raw = b.data()[:b.size()] if b.size() else b""
        if kind == k_str:
            return raw.decode("utf-8", "surrogatepass")
        if kind == k_bytes:
            return raw
        if kind == k_bytearray:
            return bytearray(raw)
        return int.from_bytes(raw, "little", signed=True)
    key = (<int>kind, v.v)
    if key in seen:
        found = seen[key]
        if found is _Undecided:  # a tuple that holds itself: Python's unpickler decides
            raise _Undecided()
        return found
    if not reader.values(v, items):  # a history entry's summary, a dropped list
        raise _Undecided()
    if kind == k_list:
        out = []
        seen[key] = out
        for i in range(items.size()):
            out.append(_to_python(reader, items[i], seen, depth + 1))
        return out
    if kind == k_dict:
        out = {}
        seen[key] = out
        for i in range(0, items.size(), 2):
            k = _to_python(reader, items[i], seen, depth + 1)
            out[k] = _to_python(reader, items[i + 1], seen, depth + 1)
        return out
    if kind == k_set:
        out = set()
        seen[key] = out
        for i in range(items.size()):
            out.add(_to_python(reader, items[i], seen, depth + 1))
        return out
    seen[key] = _Undecided
    values = [_to_python(reader, items[i], seen, depth + 1) for i in range(items.size())]
    out = tuple(values) if kind == k_tuple else frozenset(values)
    seen[key] = out
    return out


cdef class Snapshot:
    """A PyTorch memory snapshot read by the C++ unpickler: :meth:`feed` it the file's blocks
    (each returns ``"more"``, ``"done"``, ``"bail"`` where Python's unpickler must decide, or
    ``"error"`` with :meth:`error`), then :meth:`build`, :meth:`devices` and :meth:`select` a
    device."""

    cdef PickleReader* reader
    cdef SnapshotHistory* history
    cdef object __weakref__  # readers of one file share it (_fast._shared_snapshots)
    cdef object built  # None until build(), then its result
    #: The snapshot's "allocator_settings" when it is a dict, else None.
    cdef readonly object allocator_settings

    def __cinit__(self, uint64_t limit):
        self.reader = new PickleReader(limit)
        self.history = new SnapshotHistory()

    def __dealloc__(self):
        del self.reader
        del self.history

    def feed(self, const uint8_t[::1] block):
        cdef size_t n = block.shape[0]
        cdef const char* data = <const char*>&block[0] if n else <const char*>NULL
        cdef PickleStatus status
        with nogil:
            status = self.reader.feed(data, n)
        return _status_name(status)

    def finish(self):
        cdef PickleStatus status
        with nogil:
            status = self.reader.finish()
        return _status_name(status)

    def error(self):
        return self.reader.error().decode("utf-8", "replace")

    def memory(self):
        """Bytes the reader holds now (the tree, the stack, the memo, the input kept)."""
        return self.reader.memory()

    def value(self):
        """After ``done``, before :meth:`build`: the pickled value as Python objects (for
        checking the reader against ``pickle.loads``); ValueError where a history entry was
        kept as its summary, or the value is nested too deep."""
        if self.built is not None:
            raise ValueError("the pickle's tree is released by build()")
        if self.reader.root().kind == 0:
            raise ValueError("the pickle has not been read to its end")
        try:
            return _to_python(self.reader, self.reader.root(), {}, 0)
        except _Undecided:
            raise ValueError("not decided by the C++ reader") from None

    def build(self):
        """After ``done``: the snapshot's history and segments, compacted (the pickle's tree
        is released); False where the Python reader decides."""
        cdef bool ok
        cdef const PickleValue* settings
        if self.built is not None:
            return self.built
        self.built = False
        if self.reader.root().kind == k_dict:
            settings = self.reader.find(self.reader.root(), w_allocator_settings)
            if settings != NULL and settings.kind == k_dict:
                try:
                    self.allocator_settings = _to_python(self.reader, settings[0], {}, 0)
                except _Undecided:
                    return False
        with nogil:
            ok = self.history.build(self.reader[0])
            self.reader.clear()
        self.built = ok
        return ok

    def devices(self):
        """``[(is a list, entries)]`` of ``device_traces``."""
        return [(d.is_list, d.length) for d in self.history.devices]

    def select(self, size_t index):
        """Device ``index``'s :class:`SnapshotSelection`, or None where the Python reader
        decides (it raises)."""
        cdef SnapshotSelection sel = SnapshotSelection()
        cdef bool ok
        sel.snapshot = self
        with nogil:
            ok = self.history.select(index, sel.device)
        if not ok:
            return None
        names = [a.decode("utf-8", "surrogatepass") for a in self.history.actions]
        sel.actions = {names[p.first]: p.second for p in sel.device.actions}
        sel.skipped = {names[p.first]: p.second for p in sel.device.skipped}
        return sel


cdef class SnapshotSelection:
    """One device of a :class:`Snapshot`: its history's counters, and its raw records (ALLOC /
    FREE, made from the history entries as they are asked for)."""

    cdef Snapshot snapshot
    cdef SnapshotDevice device
    #: ``{action: entries}`` of every action, and of those not replayed, in order of first
    #: appearance.
    cdef readonly dict actions, skipped

    def __len__(self):
        """The raw records."""
        return self.device.records

    @property
    def entries(self):
        """The device's history entries."""
        return self.device.entries

    @property
    def segments(self):
        return self.device.segments

    @property
    def segment_bytes(self):
        return self.device.segment_bytes

    @property
    def untouched_bytes(self):
        return self.device.untouched_bytes

    cdef int _records(self, size_t first, size_t n, vector[TraceEvent]& out) except -1 nogil:
        self.snapshot.history.records(self.device, first, n, out)
        return 0

    def untouched(self):
        """``{addr: (stream, requested size)}`` of the blocks live at the dump that the
        history never mentions."""
        cdef const TraceEvent* e = self.device.untouched.data()
        cdef size_t i
        return {e[i].addr: (e[i].stream, e[i].size) for i in range(self.device.untouched.size())}

    def live_blocks(self):
        """``{addr: (stream, requested size)}`` of the device's blocks in use at the dump."""
        cdef const TraceEvent* e = self.device.live.data()
        cdef size_t i
        return {e[i].addr: (e[i].stream, e[i].size) for i in range(self.device.live.size())}

    def records(self, size_t first=0, size_t n=<size_t>-1):
        """The raw records of history entries ``[first, first + n)``, as an EVENT_DTYPE
        array."""
        cdef vector[TraceEvent] out
        with nogil:
            self._records(first, n, out)
        return _array(out.data(), out.size())

    def before_window(self):
        """``{addr: (stream, size)}`` of the frees of addresses first seen freed, in order
        (scan_before_window of the records)."""
        cdef BeforeWindowScanner scan
        cdef vector[TraceEvent] chunk
        cdef size_t first = 0, step = 1 << 16
        with nogil:
            while first < self.device.entries:
                chunk.clear()
                self._records(first, step, chunk)
                scan.feed(chunk.data(), chunk.size())
                first += step
        cdef const TraceEvent* e = scan.before.data()
        cdef size_t i
        return {e[i].addr: (e[i].stream, e[i].size) for i in range(scan.before.size())}


cdef class Kept:
    """One device's raw records kept by a pass that counts devices (:meth:`Pass.take_kept`),
    in chunks, with the ``reader_state()`` its own pass would leave (:attr:`state`)."""

    cdef vector[vector[TraceEvent]] chunks
    cdef readonly uint64_t records
    cdef readonly object state

    def __len__(self):
        """The number of chunks."""
        return self.chunks.size()


cdef class Pass:
    """One pass over a trace file's raw records: parsed by the C++ reader of ``format``
    (``"rmm_csv"`` or ``"kineto"``; ``"records"``: records parsed elsewhere), then normalized (``scan=False``) or scanned for memory
    live before the window (``scan=True``). :meth:`feed` returns False where the C++ reader
    bails out; :attr:`records` raw records had been taken until then, and the caller goes on
    with the Python reader's records from there (:meth:`feed_records`)."""

    cdef RmmCsvParser* csv
    cdef KinetoScanner* kineto
    cdef Normalizer* norm
    cdef BeforeWindowScanner* before
    cdef vector[TraceEvent] raw
    cdef readonly uint64_t records
    cdef readonly object format

    def __cinit__(self, format, want_type=0, int64_t want_id=-1, bint scan=False,
                  size_t keep_bytes=0):
        """``want_type`` None (kineto): the memory events are only counted by device; with
        ``keep_bytes``, each device's raw records are also kept while they take at most that
        many bytes (:meth:`take_kept`)."""
        self.format = format
        if format == "rmm_csv":
            self.csv = new RmmCsvParser()
        elif format == "records":
            pass  # raw records from elsewhere (feed_selection, feed_records)
        elif format == "kineto":
            self.kineto = new KinetoScanner(
                INT64_MIN if want_type is None else <int64_t>want_type, want_id)
            if want_type is None:
                self.kineto.keep_limit = keep_bytes
        else:
            raise ValueError(f"no fast reader for {format!r}")
        if scan:
            self.before = new BeforeWindowScanner()
        else:
            self.norm = new Normalizer()

    def __dealloc__(self):
        del self.csv
        del self.kineto
        del self.norm
        del self.before

    cdef int _consume(self) except -1 nogil:
        # except -1: the normalizer's std::bad_alloc arrives as MemoryError (declared except +).
        cdef size_t n = self.raw.size()
        if n:
            if self.norm != NULL:
                self.norm.feed(self.raw.data(), n)
            else:
                self.before.feed(self.raw.data(), n)
            self.records += n
            self.raw.clear()
        return 0

    def feed(self, const uint8_t[::1] block):
        """Parses the next block of the file; False: bail out (see the class)."""
        cdef size_t n = block.shape[0]
        cdef const char* data = <const char*>&block[0] if n else <const char*>NULL
        cdef bool ok
        with nogil:
            if self.csv != NULL:
                ok = self.csv.feed(data, n, self.raw)
            else:
                ok = self.kineto.feed(data, n, self.raw)
            self._consume()
        return ok

    def finish(self):
        """The end of the file; False: bail out."""
        cdef bool ok
        with nogil:
            if self.csv != NULL:
                ok = self.csv.finish(self.raw)
            else:
                ok = self.kineto.finish(self.raw)
            self._consume()
        return ok

    def feed_records(self, records):
        """Raw records (an EVENT_DTYPE array) from the Python reader."""
        records = np.ascontiguousarray(records, dtype=EVENT_DTYPE)
        cdef size_t n = len(records)
        if n == 0:
            return
        cdef const uint8_t[::1] raw = records.view(np.uint8)
        cdef const TraceEvent* events = <const TraceEvent*>&raw[0]
        with nogil:
            if self.norm != NULL:
                self.norm.feed(events, n)
            else:
                self.before.feed(events, n)
        self.records += n

    def feed_selection(self, SnapshotSelection sel, size_t first, size_t n):
        """Normalizes (or scans) the raw records of a snapshot device's history entries
        ``[first, first + n)``."""
        with nogil:
            self.raw.clear()
            sel._records(first, n, self.raw)
            self._consume()

    def feed_kept(self, Kept kept, size_t i):
        """Normalizes (or scans) chunk ``i`` of ``kept``, then frees it."""
        cdef vector[TraceEvent] empty
        cdef size_t n = kept.chunks[i].size()
        with nogil:
            if n and self.norm != NULL:
                self.norm.feed(kept.chunks[i].data(), n)
            elif n:
                self.before.feed(kept.chunks[i].data(), n)
            kept.chunks[i].swap(empty)
        self.records += n

    def live_before(self, before):
        """Starts the normalization with ``before`` (``{addr: (stream, size)}``)."""
        records = np.zeros(len(before), dtype=EVENT_DTYPE)
        if len(before):
            records["addr"] = list(before)
            records["stream"] = [s for s, _ in before.values()]
            records["size"] = [z for _, z in before.values()]
        cdef const uint8_t[::1] raw
        if len(before):
            raw = records.view(np.uint8)
            self.norm.live_before(<const TraceEvent*>&raw[0], len(before))
        else:
            self.norm.live_before(NULL, 0)

    def pending(self):
        """Normalized events not yet taken."""
        return self.norm.pending.size()

    def take(self, size_t n):
        """The next ``n`` normalized events, as an array."""
        cdef vector[TraceEvent]* pending = &self.norm.pending
        n = min(n, pending.size())
        out = _array(pending.data(), n)
        pending.erase(pending.begin(), pending.begin() + n)
        return out

    def before_window(self):
        """``{addr: (stream, size)}`` of the frees of addresses first seen freed (scan)."""
        cdef const TraceEvent* e = self.before.before.data()
        cdef size_t i
        return {e[i].addr: (e[i].stream, e[i].size) for i in range(self.before.before.size())}

    cdef object _wide(self, int which):
        cdef uint64_t hi = 0, lo = 0
        self.norm.wide(which, hi, lo)
        return (int(hi) << 64) | int(lo)

    def counters(self):
        """The normalization's counters: ``(skipped [(reason, count)], {TraceInfo field: value})``."""
        cdef Normalizer* n = self.norm
        skipped = [(_REASONS[r], n.skipped[r]) for r in n.reason_order]
        return skipped, {
            "implicit_frees": n.implicit_frees,
            "unmatched_frees": n.unmatched_frees,
            "double_frees": n.double_frees,
            "unmatched_free_bytes": self._wide(0),
            "free_size_mismatches": n.free_size_mismatches,
            "synthetic_allocs": n.synthetic_allocs,
            "synthetic_alloc_bytes": self._wide(1),
            "frees_before_window": n.frees_before_window,
            "free_before_window_bytes": self._wide(5),
            "allocs": n.allocs,
            "frees": n.frees,
            "events": n.allocs + n.frees,
            "alloc_bytes": self._wide(2),
            "largest_alloc_bytes": n.largest,
            "peak_live_bytes": self._wide(4),
            "live_at_end": n.live_count(),
            "live_at_end_bytes": self._wide(3),
            "streams": n.stream_count(),
        }

    def device_scans(self):
        """After a pass that counts devices (kineto, ``want_type`` None): ``{(type, id):
        (before_window() of that device, Total Allocated before its first event or None)}``,
        or None where the scans are not valid."""
        k = self.kineto
        if not k.scans_ok or k.device_scans.size() != k.devices.size():
            return None
        out = {}
        cdef size_t i, j
        cdef const TraceEvent* e
        cdef DeviceScan* d
        for i in range(k.devices.size()):
            d = &k.device_scans[i]
            e = d.scan.before.data()
            before = {e[j].addr: (e[j].stream, e[j].size) for j in range(d.scan.before.size())}
            allocated = None
            if d.have_allocated:
                nbytes = -int(d.first_bytes) if d.first_bytes_negative else int(d.first_bytes)
                allocated = max(0, int(d.first_allocated) - nbytes)
            out[(k.devices[i].first.first, k.devices[i].first.second)] = (before, allocated)
        return out

    def kept_bytes(self):
        """The bytes of records kept now (a pass that counts devices)."""
        return self.kineto.kept_bytes

    def take_kept(self):
        """After a pass that counts devices with ``keep_bytes``: ``{(type, id): Kept}``, the
        records moved out of the pass; None where they were dropped (over the limit, or an
        event the device's own pass would not take) or none were kept."""
        k = self.kineto
        if (k.keep_limit == 0 or k.kept_dropped or not k.scans_ok
                or k.device_scans.size() != k.devices.size()):
            return None
        metadata = [(p.first.decode(), p.second.decode()) for p in k.metadata]
        devices = [((v.first.first, v.first.second), v.second) for v in k.devices]
        out = {}
        cdef size_t i
        cdef DeviceScan* d
        cdef Kept kept
        for i in range(k.devices.size()):
            d = &k.device_scans[i]
            kept = Kept()
            kept.chunks.swap(d.kept)
            kept.records = 0
            for j in range(kept.chunks.size()):
                kept.records += kept.chunks[j].size()
            before = None
            if d.have_allocated:
                nbytes = -int(d.first_bytes) if d.first_bytes_negative else int(d.first_bytes)
                before = max(0, int(d.first_allocated) - nbytes)
            kept.state = (metadata, devices, d.out_of_order, k.ooms, d.zero_bytes,
                          (int(d.peak_allocated) if d.have_peak_allocated else None,
                           int(d.peak_reserved) if d.have_reserved else None, before))
            out[(k.devices[i].first.first, k.devices[i].first.second)] = kept
        k.kept_bytes = 0
        return out

    def reader_state(self):
        """What the Python reader's pass leaves in ``reader.metadata`` and ``reader.skipped``,
        as raw parts: for rmm_csv ``(columns, allocate_failures)``, for kineto
        ``(metadata [(key JSON, value JSON)], devices [((type, id), count)], out_of_order,
        ooms, zero_bytes, recorded)`` where ``recorded`` is ``(peak Total Allocated, peak
        Total Reserved, Total Allocated before the first event)``, each None when absent."""
        cdef vector[string] columns
        if self.csv != NULL:
            columns = self.csv.columns()
            return [c.decode() for c in columns], self.csv.allocate_failures()
        k = self.kineto
        before = None
        if k.have_allocated:
            nbytes = -int(k.first_bytes) if k.first_bytes_negative else int(k.first_bytes)
            before = max(0, int(k.first_allocated) - nbytes)
        return ([(p.first.decode(), p.second.decode()) for p in k.metadata],
                [((d.first.first, d.first.second), d.second) for d in k.devices],
                k.out_of_order, k.ooms, k.zero_bytes,
                (int(k.peak_allocated) if k.have_allocated else None,
                 int(k.peak_reserved) if k.have_reserved else None, before))
