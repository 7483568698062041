"""Fuzzing every reader: random bytes and mutations of valid traces must either read or raise
vmalloc.TraceFormatError, never any other exception. Bounded examples, small inputs."""

import gzip
import json
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.traces import EVENT_DTYPE, VmtraceWriter, open_trace

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _snapshot_bytes():
    entries = []
    for i in range(6):
        entries.append({"action": "alloc", "addr": 0x1000 * (i + 1), "size": 512 * (i + 1),
                        "stream": 0, "frames": [{"name": "f", "filename": "x.py", "line": 1}]})
    entries += [
        {"action": "free_requested", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "free_completed", "addr": 0x9000, "size": 64, "stream": 0},
        {"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0},
    ]
    segments = [{"device": 0, "address": 0x1000, "total_size": 1 << 21, "stream": 0,
                 "blocks": [{"address": 0x1000, "size": 512, "requested_size": 512,
                             "state": "active_allocated"}]}]
    return pickle.dumps({"segments": segments, "device_traces": [entries],
                         "allocator_settings": {"max_split_size": -1}}, protocol=4)


def _kineto_bytes():
    events = [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "args": {"Input Dims": [[1]]}}]
    for i, nbytes in enumerate([512, 1024, -512, 64, -1024]):
        addr = 0x1000 if abs(nbytes) == 512 else 0x2000 + (nbytes == 64)
        events.append({"ph": "i", "name": "[memory]", "ts": 10 + i, "args": {
            "Total Reserved": 0, "Total Allocated": 0, "Bytes": nbytes,
            "Device Id": 0, "Device Type": 1, "Addr": addr}})
    return json.dumps({"schemaVersion": 1, "traceEvents": events}, indent=1).encode()


def _rmm_bytes():
    return (b"Thread,Time,Action,Pointer,Size,Stream\n"
            b"1,10:00:00.000001,allocate,0x7f0000000000,1024,0x0\n"
            b"1,10:00:00.000002,allocate failure,(nil),4096,0x0\n"
            b"1,10:00:00.000003,allocate,0x7f0000000400,16,0x5\n"
            b"1,10:00:00.000004,free,0x7f0000000000,1024,0x0\n")


def _vmtrace_bytes(tmp_path_factory, encoding):
    path = tmp_path_factory.mktemp("seed") / "t.vmtrace"
    batch = np.zeros(5, dtype=EVENT_DTYPE)
    batch["op"] = [0, 0, 1, 0, 1]
    batch["addr"] = [0x10, 0x20, 0x10, 0x30, 0x20]
    batch["size"] = [8, 16, 8, 24, 16]
    with VmtraceWriter(path, encoding=encoding, consistent=True, metadata={"a": 1}) as w:
        w.write(batch)
    return path.read_bytes()


TOKENS = [b"0", b"1", b"-", b",", b'"', b"{", b"}", b"[", b"]", b":", b"\n", b"0x", b"\x00",
          b"\xff", b"9999999999999999999999", b"null", b"(nil)", b"free", b"allocate"]


@st.composite
def mutations(draw, seed):
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["set", "delete", "insert", "token", "truncate", "repeat"]))
        if not data:
            data += draw(st.binary(min_size=1, max_size=8))
            continue
        i = draw(st.integers(0, len(data) - 1))
        j = min(len(data), i + draw(st.integers(1, 24)))
        if kind == "set":
            data[i] = draw(st.integers(0, 255))
        elif kind == "delete":
            del data[i:j]
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "token":
            data[i:j] = draw(st.sampled_from(TOKENS))
        elif kind == "truncate":
            del data[i:]
        else:
            data[i:i] = data[i:j] * draw(st.integers(1, 3))
    return bytes(data)


def read_all_or_format_error(path, **options):
    """Opens and reads the whole trace: succeeding, or raising TraceFormatError only."""
    try:
        trace = open_trace(path, **options)
        for batch in trace.batches():
            assert batch.dtype == EVENT_DTYPE
            assert set(np.unique(batch["op"]).tolist()) <= {0, 1}
    except vmalloc.TraceFormatError as error:
        assert error.path == str(path)
        assert error.record is None or error.record >= 1


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(data=st.binary(max_size=512), format=st.sampled_from([None, "torch_snapshot", "kineto", "rmm_csv", "vmtrace"]))
def test_random_bytes(fuzz_dir, data, format):
    path = fuzz_dir / "random.trace"
    path.write_bytes(data)
    read_all_or_format_error(path, format=format)


@FUZZ
@given(data=mutations(_snapshot_bytes()), live=st.booleans())
def test_mutated_snapshot(fuzz_dir, data, live):
    path = fuzz_dir / "s.pickle"
    path.write_bytes(data)
    read_all_or_format_error(path, format="torch_snapshot", before_window="live" if live else "drop")


@FUZZ
@given(data=mutations(_kineto_bytes()), compress=st.booleans())
def test_mutated_kineto(fuzz_dir, data, compress):
    path = fuzz_dir / "k.json"
    path.write_bytes(gzip.compress(data) if compress else data)
    read_all_or_format_error(path, format="kineto")


@FUZZ
@given(data=mutations(gzip.compress(_kineto_bytes())))
def test_mutated_gzip(fuzz_dir, data):
    path = fuzz_dir / "k.json.gz"
    path.write_bytes(data)
    read_all_or_format_error(path)


@FUZZ
@given(data=mutations(_rmm_bytes()), live=st.booleans())
def test_mutated_rmm(fuzz_dir, data, live):
    path = fuzz_dir / "log.csv"
    path.write_bytes(data)
    read_all_or_format_error(path, format="rmm_csv", before_window="live" if live else "drop")


@pytest.mark.parametrize("encoding", ["raw", "zlib"])
def test_mutated_vmtrace(tmp_path_factory, fuzz_dir, encoding):
    seed = _vmtrace_bytes(tmp_path_factory, encoding)

    @FUZZ
    @given(data=mutations(seed))
    def run(data):
        path = fuzz_dir / f"{encoding}.vmtrace"
        path.write_bytes(data)
        read_all_or_format_error(path)

    run()


def test_seeds_are_valid(tmp_path_factory, fuzz_dir):
    # The fuzzers start from traces that read without error.
    for name, data, options in [
        ("s.pickle", _snapshot_bytes(), {}),
        ("k.json", _kineto_bytes(), {}),
        ("log.csv", _rmm_bytes(), {}),
        ("r.vmtrace", _vmtrace_bytes(tmp_path_factory, "raw"), {}),
        ("z.vmtrace", _vmtrace_bytes(tmp_path_factory, "zlib"), {}),
    ]:
        path = fuzz_dir / name
        path.write_bytes(data)
        info = open_trace(path, **options).scan()
        assert info.events > 0, name
