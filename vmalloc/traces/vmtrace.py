"""vmalloc's own trace format, ``.vmtrace``: compact, binary, streamable both ways.

Layout (all integers little-endian; the normative description is docs/trace_formats.rst)::

    header (32 bytes)
      0  8  magic          b"VMTRACE\\0"
      8  2  version        1
     10  2  encoding       0 = raw records, 1 = zlib blocks
     12  4  flags          bit 0 = consistent; other bits 0
     16  8  event count    2**64 - 1 when unknown (the writer could not seek back)
     24  4  metadata size  M, bytes of UTF-8 JSON object that follow the header (0 = none)
     28  4  reserved       0
    metadata (M bytes)
    body
      encoding 0: event records of 32 bytes, the EVENT_DTYPE layout
                  (u8 op, 7 zero bytes, u64 stream, u64 addr, u64 size)
      encoding 1: blocks, each a 12-byte block header (b"VMTB", u32 n in [1, 65536],
                  u32 payload size P) and P bytes of zlib data that inflate to exactly 25 * n
                  bytes: n op bytes, then the stream, addr and size columns, each as 8 byte
                  planes of n bytes (plane k holds byte k of every little-endian value)

*Consistent* promises what :mod:`vmalloc.traces._normalize` guarantees: every FREE names a live
address and carries its allocation's size, no ALLOC names a live address or has size 0.
Readers then pass the records through without per-event work. The byte planes put the
near-constant high bytes of addresses and sizes next to each other, which zlib compresses well
(the 4,102 events of the shared PyTorch snapshot: 128 KiB raw, 5 KiB as blocks).
"""

import json
import os
import struct
import sys
import zlib

import numpy as np

from vmalloc.errors import InvalidArgumentError, TraceFormatError
from vmalloc.traces._files import open_binary
from vmalloc.traces._normalize import scan_before_window
from vmalloc.traces.events import ALLOC, BATCH_EVENTS, EVENT_DTYPE

MAGIC = b"VMTRACE\0"
VERSION = 1
ENCODING_RAW = 0
ENCODING_ZLIB = 1
ENCODINGS = {"raw": ENCODING_RAW, "zlib": ENCODING_ZLIB}
FLAG_CONSISTENT = 1
UNKNOWN_COUNT = (1 << 64) - 1
HEADER = struct.Struct("<8sHHIQII")
assert HEADER.size == 32
BLOCK_MAGIC = b"VMTB"
BLOCK_HEADER = struct.Struct("<4sII")
#: Metadata larger than this is taken as corruption.
MAX_METADATA_BYTES = 1 << 20
#: Events per zlib block (at most).
BLOCK_EVENTS = BATCH_EVENTS
RECORD_BYTES = EVENT_DTYPE.itemsize
#: The largest compressed block a writer can produce (zlib's bound for 25 bytes an event), with
#: room to spare: a block header claiming more is corrupt, and is not read.
_MAX_BLOCK_BYTES = 25 * BLOCK_EVENTS + (25 * BLOCK_EVENTS >> 8) + 1024
_FILE_DTYPE = EVENT_DTYPE.newbyteorder("<")
_NATIVE_LITTLE = sys.byteorder == "little"


def _to_file_order(batch):
    return batch if _NATIVE_LITTLE else batch.astype(_FILE_DTYPE)


def _planes(column, n):
    """The byte planes of a uint64 column: plane k is byte k of every little-endian value."""
    return np.ascontiguousarray(column, dtype="<u8").view(np.uint8).reshape(n, 8).T.tobytes()


def encode_block(batch):
    """The zlib block (header included) holding ``batch`` (1..BLOCK_EVENTS events)."""
    n = len(batch)
    payload = b"".join(
        (
            np.ascontiguousarray(batch["op"], dtype=np.uint8).tobytes(),
            _planes(batch["stream"], n),
            _planes(batch["addr"], n),
            _planes(batch["size"], n),
        )
    )
    compressed = zlib.compress(payload, 6)
    return BLOCK_HEADER.pack(BLOCK_MAGIC, n, len(compressed)) + compressed


def decode_block_payload(raw, n):
    """An EVENT_DTYPE batch from the 25 * n inflated bytes of a block."""
    data = np.frombuffer(raw, dtype=np.uint8)
    batch = np.zeros(n, dtype=EVENT_DTYPE)
    batch["op"] = data[:n]
    for i, name in enumerate(("stream", "addr", "size")):
        start = n + 8 * n * i
        planes = data[start : start + 8 * n].reshape(8, n)
        batch[name] = np.ascontiguousarray(planes.T).view("<u8").reshape(n)
    return batch


class VmtraceWriter:
    """Writes events to a ``.vmtrace`` file as they come (constant memory).

    ``encoding`` is ``"zlib"`` (compact; the default) or ``"raw"`` (32-byte records, what the
    C++ :class:`vmalloc.LoggingAllocator` writes). ``consistent=True`` promises the events obey
    the consistency rules (set it only for events that went through a reader or were recorded
    by an allocator). ``metadata`` is a JSON-serialisable dict stored in the header. The event
    count is written into the header on :meth:`close` when the file can seek. Use as a context
    manager::

        with VmtraceWriter("job.vmtrace", consistent=True) as w:
            for batch in trace.batches():
                w.write(batch)
    """

    def __init__(self, path, encoding="zlib", consistent=False, metadata=None):
        if encoding not in ENCODINGS:
            raise InvalidArgumentError(
                f"encoding must be one of {sorted(ENCODINGS)}, got {encoding!r}"
            )
        meta = json.dumps(metadata or {}, sort_keys=True).encode() if metadata else b""
        if len(meta) > MAX_METADATA_BYTES:
            raise InvalidArgumentError(f"metadata of {len(meta)} bytes is too large")
        self.path = os.fspath(path)
        self.encoding = encoding
        self.events_written = 0
        self._encoding = ENCODINGS[encoding]
        self._flags = FLAG_CONSISTENT if consistent else 0
        self._meta = meta
        self._pending = []
        self._pending_count = 0
        self._file = open(self.path, "wb")
        self._file.write(
            HEADER.pack(MAGIC, VERSION, self._encoding, self._flags, UNKNOWN_COUNT, len(meta), 0)
        )
        self._file.write(meta)

    def write(self, batch):
        """Appends the events of ``batch`` (an EVENT_DTYPE array)."""
        if self._file is None:
            raise InvalidArgumentError(f"{self.path}: the writer is closed")
        batch = np.asarray(batch)
        if batch.dtype != EVENT_DTYPE:
            raise InvalidArgumentError(
                f"a batch must be an array of vmalloc.traces.EVENT_DTYPE, got dtype {batch.dtype}"
            )
        if batch.ndim != 1:
            raise InvalidArgumentError(f"a batch must be one-dimensional, got shape {batch.shape}")
        if len(batch) and int(batch["op"].max()) > 1:
            raise InvalidArgumentError("a batch holds an op other than ALLOC (0) and FREE (1)")
        if self._encoding == ENCODING_RAW:
            self._file.write(_to_file_order(batch).tobytes())
        else:
            self._pending.append(batch)
            self._pending_count += len(batch)
            while self._pending_count >= BLOCK_EVENTS:
                self._write_block(BLOCK_EVENTS)
        self.events_written += len(batch)

    def _write_block(self, n):
        joined = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._file.write(encode_block(joined[:n]))
        rest = joined[n:]
        self._pending = [rest] if len(rest) else []
        self._pending_count = len(rest)

    def close(self):
        """Writes what is buffered and the event count; the file is then complete."""
        if self._file is None:
            return
        try:
            if self._pending_count:
                self._write_block(self._pending_count)
            if self._file.seekable():
                self._file.seek(16)
                self._file.write(struct.pack("<Q", self.events_written))
        finally:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_header(f, path):
    """Reads and checks the header and metadata of an open ``.vmtrace``; returns a dict."""
    data = f.read(HEADER.size)
    if len(data) < HEADER.size or data[:8] != MAGIC:
        raise TraceFormatError("not a .vmtrace file (bad magic or shorter than the header)", path)
    magic, version, encoding, flags, count, meta_size, _reserved = HEADER.unpack(data)
    if version != VERSION:
        raise TraceFormatError(
            f".vmtrace version {version} is not supported (this vmalloc reads version {VERSION})",
            path,
        )
    if encoding not in (ENCODING_RAW, ENCODING_ZLIB):
        raise TraceFormatError(f"unknown .vmtrace encoding {encoding}", path)
    if flags & ~FLAG_CONSISTENT:
        raise TraceFormatError(f"unknown .vmtrace flags {flags:#x} (newer writer?)", path)
    if meta_size > MAX_METADATA_BYTES:
        raise TraceFormatError(f"metadata size {meta_size} is implausible", path)
    metadata = {}
    if meta_size:
        raw = f.read(meta_size)
        try:
            metadata = json.loads(raw.decode("utf-8")) if len(raw) == meta_size else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            metadata = None
        if not isinstance(metadata, dict):
            raise TraceFormatError("the header's metadata is not a JSON object", path)
    return {
        "version": version,
        "encoding": "raw" if encoding == ENCODING_RAW else "zlib",
        "consistent": bool(flags & FLAG_CONSISTENT),
        "events": None if count == UNKNOWN_COUNT else count,
        "metadata": metadata,
        "body_offset": HEADER.size + meta_size,
    }


class VmtraceReader:
    """The events of a ``.vmtrace`` file, streamed batch by batch."""

    format = "vmtrace"

    def __init__(self, path, kind, index):
        self.path = path
        with open_binary(path) as f:
            try:
                self.header = read_header(f, path)
            except (OSError, EOFError, zlib.error) as error:  # a corrupt .gz
                raise TraceFormatError(f"cannot read: {error}", path) from None
        # A consistent file needs no normalizing: batches go straight to the caller.
        self.direct = self.header["consistent"]
        self.metadata = dict(self.header["metadata"])
        self.metadata.update(
            vmtrace_version=self.header["version"],
            encoding=self.header["encoding"],
            consistent=self.header["consistent"],
        )

    def raw_batches(self):
        """The file's events as written, in batches of at most BATCH_EVENTS."""
        path = self.path
        declared = self.header["events"]
        read = 0
        with open_binary(path) as f:
            blocks = self._raw_records if self.header["encoding"] == "raw" else self._zlib_blocks
            try:
                f.seek(self.header["body_offset"])
                for batch in blocks(f):
                    ops = batch["op"]
                    bad = np.flatnonzero(ops > 1)
                    if len(bad):
                        record = read + int(bad[0]) + 1
                        raise TraceFormatError(
                            f"event {record} has op {int(ops[bad[0]])} (0 = ALLOC, 1 = FREE)",
                            path,
                            record,
                        )
                    read += len(batch)
                    if declared is not None and read > declared:
                        raise TraceFormatError(
                            f"more events than the {declared} the header declares",
                            path,
                            declared + 1,
                        )
                    yield batch
            except (OSError, EOFError, zlib.error) as error:  # a corrupt .gz
                raise TraceFormatError(f"cannot read: {error}", path, read + 1) from None
        if declared is not None and read != declared:
            raise TraceFormatError(
                f"truncated: {read} events where the header declares {declared}", path, read + 1
            )

    def _raw_records(self, f):
        record = 0
        while True:
            buf = bytearray(BATCH_EVENTS * RECORD_BYTES)
            n = f.readinto(buf)
            if n == 0:
                return
            if n % RECORD_BYTES:
                # readinto may return short: complete the last record if the file has it.
                while n % RECORD_BYTES:
                    more = f.read(RECORD_BYTES - n % RECORD_BYTES)
                    if not more:
                        raise TraceFormatError(
                            f"the file ends inside event record {record + n // RECORD_BYTES + 1}",
                            self.path,
                            record + n // RECORD_BYTES + 1,
                        )
                    buf[n : n + len(more)] = more
                    n += len(more)
            batch = np.frombuffer(buf, dtype=_FILE_DTYPE, count=n // RECORD_BYTES)
            if not _NATIVE_LITTLE:
                batch = batch.astype(EVENT_DTYPE)
            record += len(batch)
            yield batch

    def _zlib_blocks(self, f):
        record = 0
        block = 0
        while True:
            head = f.read(BLOCK_HEADER.size)
            if not head:
                return
            block += 1
            if len(head) < BLOCK_HEADER.size:
                raise TraceFormatError(f"the file ends inside block header {block}", self.path, record + 1)
            magic, n, size = BLOCK_HEADER.unpack(head)
            if magic != BLOCK_MAGIC or not 1 <= n <= BLOCK_EVENTS:
                raise TraceFormatError(
                    f"block {block} is corrupt (bad magic or event count {n})", self.path, record + 1
                )
            if size > _MAX_BLOCK_BYTES:
                raise TraceFormatError(
                    f"block {block} is corrupt (a compressed size of {size:,} bytes for "
                    f"{n} events)", self.path, record + 1)
            payload = f.read(size)
            if len(payload) < size:
                raise TraceFormatError(f"the file ends inside block {block}", self.path, record + 1)
            expected = 25 * n
            try:
                inflater = zlib.decompressobj()
                raw = inflater.decompress(payload, expected)
                complete = inflater.eof and not inflater.unconsumed_tail and not inflater.unused_data
            except zlib.error as error:
                raise TraceFormatError(f"block {block} is corrupt ({error})", self.path, record + 1) from None
            if len(raw) != expected or not complete:
                raise TraceFormatError(
                    f"block {block} is corrupt (inflates to a size other than {expected} bytes)",
                    self.path,
                    record + 1,
                )
            yield decode_block_payload(raw, n)
            record += n

    def direct_batches(self, info):
        """The batches of a consistent file, counting into ``info`` without per-event work."""
        allocs = frees = alloc_bytes = largest = 0
        live = live_bytes = peak = 0
        streams = set()
        for batch in self.raw_batches():
            is_alloc = batch["op"] == ALLOC
            sizes = batch["size"].astype(np.int64)
            n_alloc = int(np.count_nonzero(is_alloc))
            allocs += n_alloc
            frees += len(batch) - n_alloc
            if n_alloc:
                alloc_sizes = sizes[is_alloc]
                alloc_bytes += int(alloc_sizes.sum())
                largest = max(largest, int(alloc_sizes.max()))
            running = live_bytes + np.cumsum(np.where(is_alloc, sizes, -sizes))
            if len(running):
                peak = max(peak, int(running.max()))
                live_bytes = int(running[-1])
            live += 2 * n_alloc - len(batch)
            streams.update(np.unique(batch["stream"]).tolist())
            yield batch
        info.allocs = allocs
        info.frees = frees
        info.events = allocs + frees
        info.alloc_bytes = alloc_bytes
        info.largest_alloc_bytes = largest
        info.peak_live_bytes = peak
        info.live_at_end = live
        info.live_at_end_bytes = live_bytes
        info.streams = len(streams)
        info.complete = True

    def records(self):
        """``(op, stream, addr, size)`` per event, for files that need normalizing."""
        for batch in self.raw_batches():
            yield from zip(
                batch["op"].tolist(),
                batch["stream"].tolist(),
                batch["addr"].tolist(),
                batch["size"].tolist(),
            )

    def live_before(self):
        """Addresses freed before being allocated in the file (``before_window="live"``)."""
        return scan_before_window(self.records())

    def finish(self, info):
        """Adds what only a full pass knows to ``info`` (nothing for this format)."""
