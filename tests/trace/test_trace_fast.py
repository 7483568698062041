"""The C++ fast path of the RMM CSV and Kineto JSON readers (vmalloc.traces._fast) against the
Python readers: the same events, counters, metadata and errors (message and line) on the test
traces and on random ones, including malformed ones and block boundaries anywhere; and reading
in bounded memory."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.traces import _fast, open_trace

pytestmark = pytest.mark.skipif(_fast._trace_parse is None, reason="built without _trace_parse")

DATA = Path(__file__).resolve().parents[1] / "data"
HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def outcome(path, python, **options):
    """What reading ``path`` gives: events, info and reader metadata, or the error."""
    old = os.environ.pop("VMALLOC_PYTHON_READERS", None)
    if python:
        os.environ["VMALLOC_PYTHON_READERS"] = "1"
    try:
        trace = open_trace(path, **options)
        batches = list(trace.batches())
        return ("ok", [b.tobytes() for b in batches], trace.info.to_dict())
    except vmalloc.TraceFormatError as error:
        return ("error", str(error), error.record)
    finally:
        os.environ.pop("VMALLOC_PYTHON_READERS", None)
        if old is not None:
            os.environ["VMALLOC_PYTHON_READERS"] = old


def assert_same(path, **options):
    fast = outcome(path, python=False, **options)
    slow = outcome(path, python=True, **options)
    assert fast == slow
    return fast


@pytest.fixture(params=[_fast.BLOCK, 1, 7, 64])
def block(request, monkeypatch):
    """Blocks of every size, so that records are cut anywhere."""
    monkeypatch.setattr(_fast, "BLOCK", request.param)
    return request.param


def test_shipped_profiler_trace(block):
    for device in ("cpu", 0):
        for before_window in ("drop", "live"):
            assert_same(DATA / "profiler_cpu_mlp.json", device=device, before_window=before_window)
    assert outcome(DATA / "profiler_cpu_mlp.json", python=False, device="cpu")[0] == "ok"


def test_fast_path_is_taken(monkeypatch, tmp_path):
    """The shipped profiler trace and a plain RMM log never fall back to Python: nor does
    the device="auto" discovery pass or the before_window="live" scan."""
    from vmalloc.traces import kineto, rmm_csv

    def refuse(self, *args):
        raise AssertionError("fell back to the Python reader")
        yield

    monkeypatch.setattr(kineto.KinetoReader, "records", refuse)
    monkeypatch.setattr(kineto, "JsonEventScanner", refuse)
    monkeypatch.setattr(rmm_csv.RmmCsvReader, "records", refuse)
    for before_window in ("drop", "live"):
        assert len(open_trace(DATA / "profiler_cpu_mlp.json", device="cpu",
                              before_window=before_window).events()) > 0
    event = ('{{"name": "[memory]", "ts": {0}, "args": {{"Device Type": 1, "Device Id": 1, '
             '"Addr": {1}, "Bytes": {2}, "Total Allocated": {3}, "Total Reserved": 8192}}}}')
    path = tmp_path / "gpu.json"
    path.write_text('{"traceEvents": [' + ", ".join([
        event.format(1, 4096, -512, 2048), event.format(2, 8192, 1024, 3072)]) + "]}")
    passes = []
    new_pass = _fast._new_pass
    monkeypatch.setattr(_fast, "_new_pass", lambda r, scan: passes.append(scan) or new_pass(r, scan))
    trace = open_trace(path)  # device "auto", before_window "auto" (live)
    assert trace.device == "cuda:1"
    assert len(trace.events()) == 4  # the free's block, the rest of Total Allocated, 2 events
    assert passes == [False]  # the device count scanned for the live memory already
    assert trace.info.frees_before_window == 1
    assert trace.info.metadata["allocated_before_window_bytes"] == 2560
    assert trace.info.metadata["recorded_peak_allocated_bytes"] == 3072
    assert trace.info.metadata["recorded_peak_reserved_bytes"] == 8192
    monkeypatch.undo()
    assert_same(path)


def test_rmm_plain_and_gz(tmp_path, block):
    body = "".join(
        f"1,10:00:00.{i:06d},{'allocate' if i % 2 == 0 else 'free'},{0x7F0000000000 + (i // 2) * 256:#x},{256 + i},0x0\n"
        for i in range(200)
    )
    plain = tmp_path / "log.csv"
    plain.write_text(HEADER + body)
    assert assert_same(plain)[0] == "ok"
    gz = tmp_path / "log.csv.gz"
    gz.write_bytes(gzip.compress((HEADER + body).encode()))
    assert assert_same(gz, format="rmm_csv")[0] == "ok"
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + (HEADER + body).encode())
    assert assert_same(bom, format="rmm_csv")[0] == "ok"
    crlf = tmp_path / "crlf.csv"
    crlf.write_bytes((HEADER + body).replace("\n", "\r\n").encode())
    assert assert_same(crlf)[0] == "ok"
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(gzip.compress((HEADER + body).encode())[:-20])
    assert assert_same(cut, format="rmm_csv")[0] == "error"


# -- random RMM logs -------------------------------------------------------------------------

_POINTERS = st.one_of(
    st.integers(0, 8).map(lambda i: f"{0x7F0000000000 + i * 512:#x}"),
    st.integers(0, 8).map(lambda i: f"{0x7F0000000000 + i * 512:X}"),
    st.sampled_from(["(nil)", "0", "0x0", " 0x7f0000000200", "NULL", "0x", "zz", "-0", "0x1_0",
                     "0x10000000000000000", "00000000000000000000001", "+0x10", "0X7F0000000400"]),
)
_SIZES = st.one_of(
    st.integers(0, 4096).map(str),
    st.sampled_from(["18446744073709551615", "18446744073709551616", "-1", " 12", "1_0", "", "1.5",
                     "0007"]),
)
_ACTIONS = st.sampled_from(["allocate", "free", "deallocate", "allocate failure", " allocate",
                            "Allocate", "frees"])


@st.composite
def rmm_logs(draw):
    header = draw(st.sampled_from([HEADER, "Thread,Time,Action,Pointer,Size\n",
                                   "Action, Pointer ,Size,Stream,Extra\n", "Thread,Time\n", ""]))
    columns = [c.strip() for c in header.strip().split(",")]
    rows = []
    for _ in range(draw(st.integers(0, 30))):
        kind = draw(st.integers(0, 20))
        if kind == 0:
            rows.append("")
        elif kind == 1:
            rows.append(draw(st.sampled_from(['1,"x",allocate,0x10,1,0', "1,2", "é,1,allocate,0x10,1,0",
                                               "1,2,free,0x10,1,0\r", "  "])))
        else:
            values = {"Thread": "1", "Time": "10:00", "Action": draw(_ACTIONS),
                      "Pointer": draw(_POINTERS), "Size": draw(_SIZES), "Stream": draw(_POINTERS),
                      "Extra": "x"}
            rows.append(",".join(values.get(c, "") for c in columns))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    text = header.replace("\n", newline) + newline.join(rows)
    if draw(st.booleans()):
        text += newline
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=rmm_logs(), block_size=st.sampled_from([1, 5, 64, 1 << 20]),
       before_window=st.sampled_from(["drop", "live"]))
def test_random_rmm_logs(tmp_path, monkeypatch, text, block_size, before_window):
    monkeypatch.setattr(_fast, "BLOCK", block_size)
    path = tmp_path / "log.csv"
    path.write_bytes(text.encode())
    assert_same(path, format="rmm_csv", before_window=before_window)


# -- random profiler traces ------------------------------------------------------------------

_NAMES = st.sampled_from(["[memory]", "[memory]", "[memory]", "aten::add", "[OutOfMemory]",
                          "[mem\\u006fry]", "na\\\"me", "é ü", 5, None])
_INTS = st.one_of(st.integers(-3, 3), st.sampled_from([2**63, 2**64, -(2**64), 2**64 - 1, 1.0, "1",
                                                       True, None]))


@st.composite
def kineto_traces(draw):
    events = []
    for i in range(draw(st.integers(0, 25))):
        if draw(st.integers(0, 4)) == 0:
            events.append(json.dumps({"ph": "X", "name": "aten::mm", "ts": i, "dur": 1.5,
                                      "args": {"Input Dims": [[2, 3]], "x": "\u00e9\\"}}))
            continue
        name = draw(_NAMES)
        name_text = f'"{name}"' if isinstance(name, str) else json.dumps(name)
        args = {}
        device_type = draw(st.one_of(st.sampled_from([0, 1, 1, 1]), _INTS))
        args["Device Type"] = device_type
        if draw(st.booleans()):
            args["Device Id"] = draw(st.one_of(st.sampled_from([0, 0, 1]), _INTS))
        addr = draw(st.one_of(st.integers(0, 6).map(lambda a: 0x1000 * a), _INTS))
        args["Addr"] = addr
        args["Bytes"] = draw(st.one_of(st.sampled_from([512, -512, 1024, -1024, 0, 2**64 - 1,
                                                        -(2**64 - 1)]), _INTS))
        if draw(st.integers(0, 4)):
            args["Total Allocated"] = draw(st.one_of(st.integers(0, 1 << 20), _INTS))
        if draw(st.booleans()):
            args["Total Reserved"] = draw(st.one_of(st.integers(0, 1 << 20), _INTS))
        ts = draw(st.one_of(st.integers(0, 50), st.floats(0, 50, allow_nan=False), st.sampled_from(
            [True, None, "x", 2**60])))
        members = [f'"name": {name_text}', f'"ts": {json.dumps(ts)}',
                   f'"args": {json.dumps(args)}', '"ph": "i"']
        if draw(st.integers(0, 10)) == 0:
            members.append(draw(st.sampled_from(['"args": 3', '"name": "x"', '"args": {}'])))
        order = draw(st.permutations(members))
        events.append("{" + draw(st.sampled_from([", ", ",\n  "])).join(order) + "}")
        if draw(st.integers(0, 30)) == 0:
            events.append(draw(st.sampled_from(["[1]", "3", '{"a": 01}', '{"a": [1,]}', '{"a": "\x01"}',
                                                '{"a": NaN}', '{"a": -Infinity}', '{"a": "\\q"}'])))
    array = "[" + ",\n".join(events) + "]"
    shape = draw(st.integers(0, 5))
    if shape == 0:
        text = array
    elif shape == 1:
        text = '{"schemaVersion": 1, "traceEvents": ' + array + ', "displayTimeUnit": "ms"}'
    elif shape == 2:
        text = ('{"deviceProperties": [{"id": 0}], "traceName": "t\\u00e9", "x": 1.5e3, "n": null,'
                ' "traceEvents": ' + array + ', "x": true}\n')
    elif shape == 3:
        text = '{"other": []}'
    elif shape == 4:
        text = '{"traceEvents": ' + array + "} trailing"
    else:
        text = '  {"traceEvents": ' + array + ', "traceEvents": [' + (events[0] if events else "") + "]}"
    if draw(st.integers(0, 8)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=kineto_traces(), block_size=st.sampled_from([1, 3, 64, 1 << 20]),
       device=st.sampled_from([0, 1, "cpu", "auto"]),
       before_window=st.sampled_from(["drop", "live", "auto"]),
       bom=st.booleans())
def test_random_profiler_traces(tmp_path, monkeypatch, text, block_size, device, before_window, bom):
    monkeypatch.setattr(_fast, "BLOCK", block_size)
    path = tmp_path / "trace.json"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    assert_same(path, format="kineto", device=device, before_window=before_window)


def test_invalid_utf8_and_gz(tmp_path, block):
    event = '{"name": "[memory]", "ts": 1, "args": {"Device Type": 1, "Addr": 4096, "Bytes": 8}}'
    good = '{"traceEvents": [' + event + ', {"name": "\u00e9\u4e2d\U0001f600"}]}'
    path = tmp_path / "t.json"
    path.write_bytes(good.encode())
    assert assert_same(path)[0] == "ok"
    for bad in (b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe4\xb8"):
        path.write_bytes(good.encode().replace("\u00e9".encode(), bad))
        assert assert_same(path)[0] == "error"
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(good.encode()))
    assert assert_same(gz)[0] == "ok"


# -- bounded memory --------------------------------------------------------------------------

_MEMORY_SCRIPT = r"""
import resource, sys
from vmalloc.traces import _fast, open_trace
from vmalloc.traces import reader as reader_module

LINES = 2_000_000  # about 110 MB of log, generated as it is read: never on disk or whole

class Log:
    def __init__(self):
        self.i = -1
        self.reads = []
        self.rest = b""
    def read(self, n):
        if self.i >= LINES:
            return b""
        if self.i < 0:
            self.i = 0
            return b"Thread,Time,Action,Pointer,Size,Stream\n"
        out = []
        size = 0
        while size < n and self.i < LINES:
            i = self.i
            line = b"140573312345856,14:03:22.123456,%s,0x%x,%d,0x0\n" % (
                b"allocate" if i % 2 == 0 else b"free", 0x7F0000000000 + (i // 2 % 64) * 4096, 4096)
            out.append(line)
            size += len(line)
            self.i += 1
        return b"".join(out)
    def readinto(self, view):
        self.reads.append(len(view))
        if not self.rest:
            self.rest = self.read(len(view))
        data, self.rest = self.rest[: len(view)], self.rest[len(view):]
        view[: len(data)] = data
        return len(data)
    def __enter__(self):
        return self
    def __exit__(self, *a):
        pass

log = Log()
_fast.open_binary = lambda path: log
path = sys.argv[1]
trace = open_trace(path, format="rmm_csv")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
events = sum(len(b) for b in trace.batches())
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert events == LINES, events
print(after - before, max(log.reads))
"""


def test_bounded_memory(tmp_path):
    """A 110 MB log read through the fast path grows the peak RSS by a few MB: blocks of
    BLOCK bytes, never the whole file."""
    path = tmp_path / "log.csv"
    path.write_text(HEADER)  # open_trace's format detection reads the real file's head
    env = dict(os.environ)
    env.pop("VMALLOC_PYTHON_READERS", None)
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(path)], capture_output=True,
                            text=True, env=env, check=True, cwd=tmp_path)
    growth_kb, largest_read = map(int, result.stdout.split())
    assert largest_read <= _fast.BLOCK
    assert growth_kb < 40_000, f"peak RSS grew by {growth_kb} KB reading 110 MB"


# -- one pass for the default replay of a profiler trace -------------------------------------

def _profiler_trace(path, n, gz=False):
    """A profiler trace of ``n`` memory events on cuda:0 (plus a few on the CPU), pairs of
    alloc and free over a few addresses, some freed before the window."""
    parts = []
    for i in range(n):
        addr = 0x7F0000000000 + (i // 2 % 97) * 4096
        size = 512 * (1 + i % 5)
        if i % 2:
            size = -512 * (1 + (i - 1) % 5)
        if i < 6:  # frees of memory allocated before the window
            addr, size = 0x7E0000000000 + i * 4096, -1024
        device = '"Device Type": 0' if i % 50 == 0 else '"Device Type": 1, "Device Id": 0'
        parts.append('{"name": "[memory]", "ph": "i", "ts": %d, "args": {%s, "Addr": %d, '
                     '"Bytes": %d, "Total Allocated": %d, "Total Reserved": %d}}'
                     % (i, device, addr, size, 1 << 20, 2 << 20))
        if i % 4 == 3:
            parts.append('{"name": "aten::mm", "ph": "X", "ts": %d, "dur": 1.5, "args": {}}' % i)
    text = '{"schemaVersion": 1, "traceEvents": [\n' + ",\n".join(parts) + '\n], "x": 2}'
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _replay_json(capsys, path):
    from vmalloc.cli import main

    assert main(["replay", str(path), "-a", "caching", "--no-min-capacity", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for result in out["results"] if isinstance(out, dict) and "results" in out else out:
        for key in list(result):
            if key.endswith("seconds") or key.endswith("_per_second"):
                del result[key]
    return out


@pytest.mark.parametrize("gz", [False, True])
def test_default_replay_reads_a_profiler_trace_once(tmp_path, monkeypatch, capsys, gz):
    """The CLI's default (device auto, before_window live) decodes the file once: the
    device count keeps the events for the replay. Over KEEP_BYTES it reads the file twice,
    with the same results; and the events, counters and metadata match the Python reader's."""
    path = _profiler_trace(tmp_path / ("t.json.gz" if gz else "t.json"), 40_000, gz)
    monkeypatch.setattr(_fast, "file_passes", 0)
    once = _replay_json(capsys, path)
    assert _fast.file_passes == 1
    assert _fast._kept is None  # taken: nothing held after the replay
    monkeypatch.setattr(_fast, "KEEP_BYTES", 512 << 10)  # one chunk: 16384 events
    monkeypatch.setattr(_fast, "file_passes", 0)
    twice = _replay_json(capsys, path)
    assert _fast.file_passes == 2
    assert _fast._kept is None
    assert once == twice
    monkeypatch.undo()
    assert_same(path)
    assert_same(path, before_window="drop")


def test_kept_events_stay_within_the_cap(tmp_path):
    """The device count keeps at most its cap of decoded events; beyond it drops them all."""
    path = _profiler_trace(tmp_path / "t.json", 40_000)
    data = path.read_bytes()
    for cap, kept in ((64 << 20, True), (1 << 20, False), (0, False)):
        fast = _fast._trace_parse.Pass("kineto", None, -1, True, cap)
        for i in range(0, len(data), 1 << 16):
            assert fast.feed(data[i:i + (1 << 16)])
            assert fast.kept_bytes() <= cap
        assert fast.finish()
        by_device = fast.take_kept()
        assert (by_device is not None) == kept
        if kept:
            assert sum(k.records for k in by_device.values()) == 40_000  # none zero-byte


def test_a_device_id_beyond_int64_is_left_to_the_python_reader(tmp_path):
    """Hypothesis found it: "Device Id": 2**63 overflowed the C++ pass's int64 ordinal."""
    import json

    from vmalloc.traces import open_trace

    big = 1 << 63
    events = [{"ph": "i", "name": "[memory]", "ts": t, "pid": 1, "tid": 1,
               "args": {"Addr": 4096, "Bytes": n, "Device Type": 1, "Device Id": big}}
              for t, n in ((1, 512), (2, -512))]
    path = tmp_path / "big_id.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert open_trace(path, device=f"cuda:{big}").scan().events == 2
