"""open_trace: format detection, arguments, and the Trace object's contract (batches of
EVENT_DTYPE, info before and after a pass, repeatable passes)."""

import gzip
import pickle

import numpy as np
import pytest

import vmalloc
from vmalloc import traces
from vmalloc.traces import ALLOC, EVENT_DTYPE, FREE, Trace, detect_format, open_trace

CSV = "Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,8,0\n1,t,free,0x10,8,0\n"


def test_public_names():
    assert vmalloc.traces is traces
    assert vmalloc.TraceFormatError is traces.TraceFormatError
    assert issubclass(vmalloc.TraceFormatError, vmalloc.VmallocError)
    assert issubclass(vmalloc.TraceFormatError, ValueError)
    for name in ("open_trace", "convert", "builtin_traces", "EVENT_DTYPE", "ALLOC", "FREE"):
        assert name in traces.__all__
    assert traces.FORMATS == ("torch_snapshot", "kineto", "rmm_csv", "vmtrace")


def test_error_attributes():
    error = vmalloc.TraceFormatError("bad size", "x.csv", 12)
    assert (error.path, error.record) == ("x.csv", 12)
    assert str(error) == "x.csv:12: bad size"
    assert str(vmalloc.TraceFormatError("no events", "y.json")) == "y.json: no events"


@pytest.mark.parametrize(
    "name, data, expected",
    [
        ("a", b"VMTRACE\0" + bytes(24), "vmtrace"),
        ("a", pickle.dumps({"device_traces": []}, protocol=4), "torch_snapshot"),
        ("a", b'  \n{"traceEvents": []}', "kineto"),
        ("a", b"\xef\xbb\xbf[]", "kineto"),
        ("a", CSV.encode(), "rmm_csv"),
        ("a.gz", gzip.compress(CSV.encode()), "rmm_csv"),
        ("a.json.gz", gzip.compress(b'{"traceEvents": []}'), "kineto"),
        ("t.pkl", b"", "torch_snapshot"),  # no content to go by: the name decides
        ("t.csv", b"", "rmm_csv"),
    ],
)
def test_detect_format(tmp_path, name, data, expected):
    path = tmp_path / name
    path.write_bytes(data)
    assert detect_format(path) == expected


def test_undetectable(tmp_path):
    path = tmp_path / "mystery.bin"
    path.write_bytes(b"hello")
    with pytest.raises(vmalloc.TraceFormatError, match="pass format= one of torch_snapshot") as error:
        open_trace(path)
    assert error.value.path == str(path)


def test_arguments(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(CSV)
    with pytest.raises(vmalloc.InvalidArgumentError, match="unknown trace format 'xml'"):
        open_trace(path, format="xml")
    with pytest.raises(vmalloc.InvalidArgumentError, match="before_window must be one of auto, drop, live"):
        open_trace(path, before_window="keep")
    with pytest.raises(vmalloc.InvalidArgumentError, match="device must be"):
        open_trace(path, device="gpu7")
    with pytest.raises(vmalloc.InvalidArgumentError, match="device must be"):
        open_trace(path, device=-1)
    with pytest.raises(FileNotFoundError):
        open_trace(tmp_path / "missing.csv")
    assert open_trace(path, format="rmm").format == "rmm_csv"  # aliases
    assert open_trace(path, device="cuda:3").device == "cuda:3"


def test_trace_contract(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(CSV)
    trace = open_trace(path)
    assert isinstance(trace, Trace)
    assert repr(trace) == f"<Trace rmm_csv {str(path)!r} device=cuda:0>"
    # Before a pass: what the file states up front only.
    assert trace.info.complete is False
    assert trace.info.events is None
    batches = list(trace.batches())
    assert [b.dtype for b in batches] == [EVENT_DTYPE]
    assert trace.info.complete is True
    assert trace.info.events == 2
    # Passes repeat (the file is read again) and iteration is the same as batches().
    again = np.concatenate(list(trace))
    assert np.array_equal(again, batches[0])
    assert [tuple(int(v) for v in e) for e in again] == [(ALLOC, 0, 0x10, 8), (FREE, 0, 0x10, 8)]
    # An abandoned pass leaves the last complete info in place.
    gen = trace.batches()
    next(gen)
    gen.close()
    assert trace.info.complete is True and trace.info.events == 2


def test_empty_trace(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("Thread,Time,Action,Pointer,Size,Stream\n")
    trace = open_trace(path)
    events = trace.events()
    assert events.dtype == EVENT_DTYPE and len(events) == 0
    assert trace.info.events == 0 and trace.info.peak_live_bytes == 0
