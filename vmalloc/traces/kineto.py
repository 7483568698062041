"""Reader of PyTorch profiler traces (Kineto's chrome-trace JSON).

``torch.profiler.profile(profile_memory=True)`` records one ``[memory]`` instant event per
allocator call: ``args`` holds ``Addr``, ``Bytes`` (positive for an allocation, negative for a
free), ``Device Type`` (c10's DeviceType: 0 = CPU, 1 = CUDA), ``Device Id`` and the running
totals. Events are taken in file order (the order the profiler recorded them). The file is
streamed (see :mod:`vmalloc.traces._json_stream`); a ``.json.gz`` is decompressed on the fly.
Memory events carry no stream: every event is on stream 0.
"""

from vmalloc.errors import TraceFormatError
from vmalloc.traces import _fast
from vmalloc.traces._fields import AUTO, NoDeviceEventsError, device_name, only_gpu_device, u64
from vmalloc.traces._files import open_text
from vmalloc.traces._json_stream import JsonEventScanner
from vmalloc.traces._record_reader import RecordReaderPass
from vmalloc.traces.events import ALLOC, FREE

#: The trace address of the synthetic block holding the memory live before the window that
#: no event mentions (PyTorch's addresses are 512-byte aligned and far below it).
LIVE_BEFORE_ADDR = (1 << 64) - (1 << 12)

#: c10::DeviceType values.
DEVICE_TYPES = {"cpu": 0, "cuda": 1}
_DEVICE_TYPE_NAMES = {0: "cpu", 1: "cuda"}


def _device_label(device_type, device_id):
    name = _DEVICE_TYPE_NAMES.get(device_type, f"device type {device_type}")
    return name if device_type == 0 else f"{name}:{device_id}"


class KinetoReader(RecordReaderPass):
    """The memory events of one device of a profiler trace."""

    format = "kineto"
    direct = False

    def __init__(self, path, kind, index):
        self.path = path
        self.metadata = {}
        self.skipped = {}
        if kind == AUTO:
            # The trace's only GPU device (a rank of a multi-GPU job records its own): one
            # pass over the file to find it.
            name = only_gpu_device(self.devices(), path)
            _fast.keep_only((name,))  # the count kept every device's events
            kind, index = "cuda", int(name.split(":")[1])
        self.kind = kind
        self.index = index
        self.device_type = DEVICE_TYPES[kind]
        #: The device whose events are read, as ``"cuda:N"`` or ``"cpu"``.
        self.device = device_name(kind, index)

    def _live_before_rest(self, before):
        """Memory allocated before the trace's first event, for ``before_window="live"``: each
        address freed without being allocated in the trace (``before``: with the size its free
        names), then, as one block at :data:`LIVE_BEFORE_ADDR`, the rest of what PyTorch's
        ``Total Allocated`` counter says was allocated before the first event (memory live
        through the whole window, weights say, that no event mentions)."""
        total = self.metadata.get("allocated_before_window_bytes") or 0
        rest = total - sum(size for _, size in before.values())
        if rest > 0 and LIVE_BEFORE_ADDR not in before:
            before[LIVE_BEFORE_ADDR] = (0, rest)
        return before

    def devices(self):
        """``{device: memory events}`` of the whole trace (``"cuda:1"``, ``"cpu"``, ...), in
        device order: one pass over the file (in C++ where it can)."""
        counts = _fast.kineto_devices(self.path)
        if counts is not None:
            return {_device_label(t, i): n for (t, i), n in counts.items()}
        counts = {}
        with open_text(self.path) as text:
            for line, event in JsonEventScanner(text, self.path).events():
                if not isinstance(event, dict):
                    raise TraceFormatError("a trace event is not a JSON object", self.path, line)
                if event.get("name") != "[memory]":
                    continue
                args = event.get("args")
                if not isinstance(args, dict):
                    raise TraceFormatError("[memory] event without an 'args' object", self.path, line)
                device_type = args.get("Device Type")
                device_id = args.get("Device Id", 0)
                if type(device_type) is not int or type(device_id) is not int:
                    raise TraceFormatError(
                        "[memory] event without integer 'Device Type' and 'Device Id'",
                        self.path, line)
                key = (device_type, device_id)
                counts[key] = counts.get(key, 0) + 1
        if not counts:
            raise TraceFormatError(
                "the trace has no '[memory]' events: profile with "
                "torch.profiler.profile(profile_memory=True)",
                self.path,
            )
        return {_device_label(t, i): n for (t, i), n in sorted(counts.items())}

    def records(self):
        """``(op, stream, addr, size)`` for each memory event of the device, in file order."""
        path = self.path
        self.skipped = {}  # counts of this pass only (a before_window="live" scan is another)
        want_type = self.device_type
        want_id = self.index
        devices = {}
        out_of_order = 0
        last_ts = None
        matched = 0
        ooms = 0
        # PyTorch's own counters after each event of the device: bytes allocated (the sum of
        # its live blocks) and reserved (its segments).
        before_window = None  # allocated before the first event: Total Allocated - Bytes
        peak_allocated = peak_reserved = None
        with open_text(path) as text:
            scanner = JsonEventScanner(text, path)
            for line, event in scanner.events():
                if not isinstance(event, dict):
                    raise TraceFormatError("a trace event is not a JSON object", path, line)
                name = event.get("name")
                if name != "[memory]":
                    if name == "[OutOfMemory]":
                        ooms += 1
                    continue
                args = event.get("args")
                if not isinstance(args, dict):
                    raise TraceFormatError("[memory] event without an 'args' object", path, line)
                device_type = args.get("Device Type")
                device_id = args.get("Device Id", 0)
                if type(device_type) is not int or type(device_id) is not int:
                    raise TraceFormatError(
                        "[memory] event without integer 'Device Type' and 'Device Id'", path, line
                    )
                key = (device_type, device_id)
                devices[key] = devices.get(key, 0) + 1
                if device_type != want_type or (want_id is not None and device_id != want_id):
                    continue
                addr = u64(args.get("Addr"), "'Addr'", path, line)
                nbytes = args.get("Bytes")
                if type(nbytes) is not int or not -(1 << 64) < nbytes < (1 << 64):
                    raise TraceFormatError(
                        f"'Bytes' must be an integer, got {nbytes!r:.60}", path, line
                    )
                ts = event.get("ts")
                if isinstance(ts, (int, float)):
                    if last_ts is not None and ts < last_ts:
                        out_of_order += 1
                    last_ts = ts
                matched += 1
                allocated = args.get("Total Allocated")
                if type(allocated) is int:
                    if before_window is None:
                        before_window = max(0, allocated - nbytes)
                    if peak_allocated is None or allocated > peak_allocated:
                        peak_allocated = allocated
                reserved = args.get("Total Reserved")
                if type(reserved) is int and (peak_reserved is None or reserved > peak_reserved):
                    peak_reserved = reserved
                if nbytes > 0:
                    yield ALLOC, 0, addr, nbytes
                elif nbytes < 0:
                    yield FREE, 0, addr, -nbytes
                else:
                    self.skipped["zero-byte memory event"] = (
                        self.skipped.get("zero-byte memory event", 0) + 1
                    )
        self.metadata = dict(scanner.metadata)
        self.metadata["memory_events_by_device"] = {
            _device_label(t, i): n for (t, i), n in sorted(devices.items())
        }
        self.metadata["memory_events_out_of_time_order"] = out_of_order
        # PyTorch's counters as recorded (None when the trace lacks them): what it actually
        # allocated and reserved at its peak, and what was allocated before the first event.
        self.metadata["recorded_peak_allocated_bytes"] = peak_allocated
        self.metadata["recorded_peak_reserved_bytes"] = peak_reserved
        self.metadata["allocated_before_window_bytes"] = before_window
        if ooms:
            self.skipped["oom"] = ooms
        if not devices:
            raise TraceFormatError(
                "the trace has no '[memory]' events: profile with "
                "torch.profiler.profile(profile_memory=True)",
                path,
            )
        if not matched:
            raise NoDeviceEventsError(self.device, self.metadata["memory_events_by_device"], path)
