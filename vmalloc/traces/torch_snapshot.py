"""Reader of PyTorch CUDA memory snapshots (``torch.cuda.memory._dump_snapshot``).

A snapshot is a plain pickle of a dict: ``device_traces[device]`` lists the allocator's
actions in order (``alloc``, ``free_requested``, ``free_completed``, ``segment_*``, ``oom``,
``snapshot``), ``segments`` the memory PyTorch held when it was dumped. It is read whole (a
pickle cannot be streamed) with an unpickler that refuses every class: a snapshot holds only
dicts, lists, strings and numbers, so a hostile file cannot run code. torch is not needed.

Mapping: ``alloc`` -> ALLOC. PyTorch frees in two steps: ``free_requested`` when the tensor
dies, ``free_completed`` when the block may be reused (after the streams that used it are done).
Replay wants the second, so ``free_completed`` -> FREE; a ``free_requested`` -> FREE only when
no ``free_completed`` of that address follows before the address is allocated again (traces
recorded with ``skip_actions=["free_completed"]``, or cut off at the end). ``oom`` and the
``segment_*`` and ``snapshot`` actions are counted in ``info.skipped``.

The history is a ring buffer (``max_entries``): its oldest entries are lost, and memory
allocated before recording began (weights, optimizer state) never appears. See
:func:`vmalloc.traces.open_trace` (``before_window``) for what is done with both.

Fast path: the file is read by a restricted unpickler in C++ (``src/trace/pickle_reader.cpp``,
through :func:`vmalloc.traces._fast.snapshot`) that walks the opcodes once and keeps each
history entry as four numbers, building no Python object; the snapshot's rules
(``src/trace/torch_snapshot.cpp``) then give the device's raw records, counters and metadata.
It takes plain data only and refuses an opcode that loads a class or calls a function
(``GLOBAL``, ``STACK_GLOBAL``, ``REDUCE``, ...) with an error naming it and its byte offset.
Anything else it does not decide (an entry the reader would refuse, a protocol 0 pickle, a
truncated file) is read again by the Python code below, which stays the reference for the
events, counters, metadata and errors (``VMALLOC_PYTHON_READERS=1`` forces it).
"""

import io
import pickle
import zlib

from vmalloc.errors import InvalidArgumentError, TraceFormatError
from vmalloc.traces import _fast
from vmalloc.traces._fields import AUTO, only_gpu_device, u64
from vmalloc.traces._files import CappedReader, open_binary
from vmalloc.traces._normalize import scan_before_window
from vmalloc.traces.events import ALLOC, FREE

#: The first bytes of a pickle of protocol 2 or later (what torch writes).
PICKLE_MAGIC = b"\x80"

#: A snapshot (decompressed) larger than this is refused: the pickle is unpickled whole, and
#: real snapshots (a ring buffer of at most a few 100,000 entries) are well below it.
MAX_SNAPSHOT_BYTES = 2 << 30

_LIVE_BLOCK_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")


class _NoClassesUnpickler(pickle.Unpickler):
    """Loads plain data only: a snapshot needs no class, and refusing them all means a
    crafted file cannot make the unpickler import and call anything."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a memory snapshot holds plain data only"
        )


def load_snapshot(path, data=None, limit=None):
    """The snapshot dict of the pickle at ``path`` (or of the bytes ``data``).

    The file is unpickled as it is read (a .gz decompressed block by block), through a reader
    that refuses to pass ``limit`` bytes (default :data:`MAX_SNAPSHOT_BYTES`): garbage stops at
    its first bad opcode and a gzip bomb at the limit, without reading the file whole.
    """
    limit = MAX_SNAPSHOT_BYTES if limit is None else limit
    if data is not None:
        return _unpickle(io.BytesIO(data), path)
    with open_binary(path) as f:
        return _unpickle(CappedReader(f, limit, path, "the snapshot"), path)


def _unpickle(f, path):
    try:
        snapshot = _NoClassesUnpickler(f).load()
    except TraceFormatError:
        raise
    except (OSError, EOFError, zlib.error) as error:  # a corrupt .gz, a truncated pickle
        if isinstance(error, EOFError) or getattr(error, "errno", None) is None:
            raise TraceFormatError(
                f"not a PyTorch memory snapshot: cannot read ({type(error).__name__}: "
                f"{error})", path) from None
        raise
    except RecursionError:
        raise TraceFormatError("not a PyTorch memory snapshot: pickle nested too deeply", path)
    except MemoryError:
        # Python's unpickler allocates what a length field announces before reading it: a
        # corrupt length fails here as surely as a snapshot too large for the machine.
        raise TraceFormatError(
            "cannot unpickle: it asks for more memory than this machine has (a length in the "
            "pickle past what the file holds, or a snapshot too large for this machine)",
            path) from None
    except Exception as error:  # pickle reports corruption with many exception types
        raise TraceFormatError(
            f"not a PyTorch memory snapshot: cannot unpickle ({type(error).__name__}: "
            f"{error})",
            path,
        ) from None
    if not isinstance(snapshot, dict):
        raise TraceFormatError(
            f"not a PyTorch memory snapshot: the pickle holds a {type(snapshot).__name__}, "
            "not a dict",
            path,
        )
    if "device_traces" not in snapshot:
        raise TraceFormatError(
            "the snapshot has no allocation history ('device_traces'): call "
            "torch.cuda.memory._record_memory_history() before the code you snapshot",
            path,
        )
    if not isinstance(snapshot["device_traces"], list):
        raise TraceFormatError("'device_traces' is not a list", path)
    return snapshot


def _device_counts(lengths):
    """``{"cuda:N": entries}`` of the devices with a history, from ``(is a list, entries)``
    of each ``device_traces`` item (``{"cuda:0": 0}`` when none has one)."""
    counts = {f"cuda:{i}": n for i, (is_list, n) in enumerate(lengths) if is_list and n}
    return counts or ({"cuda:0": 0} if lengths else {})


def _lengths(traces):
    return [(isinstance(t, list), len(t) if isinstance(t, list) else 0) for t in traces]


def snapshot_devices(path):
    """``{device: history entries}`` of the snapshot at ``path`` (the devices with a
    history). The C++ reading is kept for the :class:`TorchSnapshotReader` that follows."""
    parsed = _fast.snapshot(path, MAX_SNAPSHOT_BYTES, keep=True)
    if parsed is not None:
        return _device_counts(parsed.devices())
    return _device_counts(_lengths(load_snapshot(path)["device_traces"]))


def _chosen_device(lengths, kind, index, path):
    """The ordinal to read: the only device with a history for ``"auto"``; raises where the
    snapshot has no such device (the same errors on both paths)."""
    if kind == AUTO:
        index = int(only_gpu_device(_device_counts(lengths), path).split(":")[1])
    if index >= len(lengths):
        raise TraceFormatError(
            f"the snapshot has no device {index}: it records "
            + (f"devices 0..{len(lengths) - 1}" if lengths else "no device"),
            path,
        )
    if not lengths[index][0]:
        raise TraceFormatError(f"device_traces[{index}] is not a list", path)
    return index


class TorchSnapshotReader:
    """The events of one device of a PyTorch memory snapshot."""

    format = "torch_snapshot"
    direct = False  # events go through the normalizer

    def __init__(self, path, kind, index):
        if kind not in ("cuda", AUTO):
            raise InvalidArgumentError(
                f"a PyTorch memory snapshot holds CUDA devices only, not {kind!r}"
            )
        self.path = path
        #: The device's history read in C++ (a ``_trace_parse.SnapshotSelection``), or None
        #: where the Python code below reads the snapshot.
        self._selection = None
        parsed = _fast.snapshot(path, MAX_SNAPSHOT_BYTES)
        if parsed is not None:
            lengths = parsed.devices()
            index = _chosen_device(lengths, kind, index, path)
            selection = parsed.select(index)
            if selection is not None:
                self._open(index, lengths)
                self._selection = selection
                self.skipped = {}
                untouched = selection.untouched()
                self.metadata = self._metadata_of(
                    selection.entries, selection.actions, len(lengths), selection.segments,
                    selection.segment_bytes, len(untouched), selection.untouched_bytes,
                    parsed.allocator_settings)
                return
        snapshot = load_snapshot(path)
        traces = snapshot["device_traces"]
        lengths = _lengths(traces)
        index = _chosen_device(lengths, kind, index, path)
        self._open(index, lengths)
        self.entries = traces[index]
        self.segments = snapshot.get("segments") or []
        if not isinstance(self.segments, list):
            raise TraceFormatError("'segments' is not a list", path)
        self._effective_requests = self._free_requests_without_completion()
        self.metadata = self._metadata(snapshot)

    def _open(self, index, lengths):
        #: The device whose events are read, ``"cuda:N"``.
        self.device = f"cuda:{index}"
        self.index = index
        self._device_counts = _device_counts(lengths)

    def devices(self):
        """``{device: history entries}`` of the devices with a history."""
        return dict(self._device_counts)

    def _entry(self, i):
        entry = self.entries[i]
        if not isinstance(entry, dict) or not isinstance(entry.get("action"), str):
            raise TraceFormatError(
                f"trace entry {i + 1} of device {self.index} is not a dict with an 'action'",
                self.path,
                i + 1,
            )
        return entry

    def _addr(self, entry, i):
        return u64(entry.get("addr"), "'addr'", self.path, i + 1)

    def _free_requests_without_completion(self):
        """Indices of the ``free_requested`` entries that act as the free: those not followed
        by a ``free_completed`` of the same address before it is allocated again."""
        completed_later = set()  # addresses with a free_completed ahead (scanning backwards)
        effective = set()
        for i in range(len(self.entries) - 1, -1, -1):
            entry = self._entry(i)
            action = entry["action"]
            if action == "free_completed":
                completed_later.add(self._addr(entry, i))
            elif action == "free_requested":
                addr = self._addr(entry, i)
                if addr in completed_later:
                    completed_later.discard(addr)
                else:
                    effective.add(i)
            elif action == "alloc":
                completed_later.discard(self._addr(entry, i))
        return effective

    def records(self):
        """``(op, stream, addr, size)`` for every alloc and free, in trace order."""
        if self._selection is not None:
            yield from map(tuple, self._selection.records().tolist())
            self.skipped = dict(self._selection.skipped)
            return
        path = self.path
        effective = self._effective_requests
        skipped = {}
        for i, entry in enumerate(self.entries):
            action = entry["action"]
            if action == "alloc":
                op = ALLOC
            elif action == "free_completed" or (action == "free_requested" and i in effective):
                op = FREE
            else:
                if action != "free_requested":
                    skipped[action] = skipped.get(action, 0) + 1
                continue
            addr = u64(entry.get("addr"), "'addr'", path, i + 1)
            size = u64(entry.get("size", 0), "'size'", path, i + 1)
            stream = u64(entry.get("stream", 0), "'stream'", path, i + 1)
            yield op, stream, addr, size
        self.skipped = skipped

    def live_blocks(self):
        """``{addr: (stream, requested size)}`` of the blocks of this device that were in
        use when the snapshot was taken."""
        if self._selection is not None:
            return self._selection.live_blocks()
        blocks = {}
        for s, segment in enumerate(self.segments):
            if not isinstance(segment, dict):
                raise TraceFormatError(f"segment {s + 1} is not a dict", self.path, s + 1)
            if segment.get("device", self.index) != self.index:
                continue
            stream = segment.get("stream", 0)
            segment_blocks = segment.get("blocks") or []
            if not isinstance(segment_blocks, list):
                raise TraceFormatError(f"segment {s + 1}: 'blocks' is not a list", self.path, s + 1)
            for block in segment_blocks:
                if not isinstance(block, dict) or block.get("state") not in _LIVE_BLOCK_STATES:
                    continue
                addr = u64(block.get("address"), "block 'address'", self.path, s + 1)
                size = block.get("requested_size") or block.get("size", 0)
                size = u64(size, "block 'size'", self.path, s + 1)
                blocks[addr] = (u64(stream, "segment 'stream'", self.path, s + 1), size)
        return blocks

    def _untouched_live_blocks(self):
        """Blocks live at the dump whose address the history never mentions: they were
        allocated before the window and stayed live through all of it."""
        mentioned = set()
        for entry in self.entries:
            if entry["action"] in ("alloc", "free_requested", "free_completed"):
                addr = entry.get("addr")
                if type(addr) is int:
                    mentioned.add(addr)
        return {a: v for a, v in self.live_blocks().items() if a not in mentioned}

    def live_before(self):
        """Memory allocated before the window, for ``before_window="live"``: the addresses
        freed in the window without being allocated in it, then the blocks live throughout."""
        if self._selection is not None:
            before = self._selection.before_window()
            untouched = self._selection.untouched()
        else:
            before = scan_before_window(self.records())
            untouched = self._untouched_live_blocks()
        for addr, value in untouched.items():
            before.setdefault(addr, value)
        return before

    def finish(self, info):
        """Adds what only a full pass knows to ``info``."""
        for action, count in getattr(self, "skipped", {}).items():
            info.skip(action, count)

    def _metadata(self, snapshot):
        actions = {}
        for entry in self.entries:
            action = entry.get("action")
            actions[action] = actions.get(action, 0) + 1
        segment_bytes = 0
        segment_count = 0
        for segment in self.segments:
            if isinstance(segment, dict) and segment.get("device", self.index) == self.index:
                segment_count += 1
                size = segment.get("total_size", 0)
                segment_bytes += size if type(size) is int else 0
        untouched = self._untouched_live_blocks()
        settings = snapshot.get("allocator_settings")
        return self._metadata_of(
            len(self.entries), actions, len(snapshot["device_traces"]), segment_count,
            segment_bytes, len(untouched), sum(size for _, size in untouched.values()),
            settings if isinstance(settings, dict) else None)

    @staticmethod
    def _metadata_of(entries, actions, devices, segments, segment_bytes, untouched,
                     untouched_bytes, settings):
        metadata = {
            "trace_entries": entries,
            "actions": actions,
            "devices": devices,
            "segments": segments,
            "segment_bytes": segment_bytes,
            "live_before_window_blocks": untouched,
            "live_before_window_bytes": untouched_bytes,
        }
        if settings is not None:
            metadata["allocator_settings"] = settings
        return metadata
