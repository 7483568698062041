"""The Kineto JSON fast path's shortcuts against the Python reader: strings closed within one
16-byte vector (and those that are not: escapes, control bytes, non-ASCII at every offset),
events stitched across blocks larger than the stitch (so parsed partly in place), and the
device count's batched before-window scans (more records than one batch, several devices)."""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.traces import _fast, open_trace

pytestmark = pytest.mark.skipif(_fast._trace_parse is None, reason="built without _trace_parse")

STITCH = 16384  # KinetoScanner::stitch_bytes


def outcome(path, python, **options):
    """What reading ``path`` gives: events, info and reader metadata, or the error."""
    old = os.environ.pop("VMALLOC_PYTHON_READERS", None)
    if python:
        os.environ["VMALLOC_PYTHON_READERS"] = "1"
    try:
        trace = open_trace(path, **options)
        return ("ok", [b.tobytes() for b in trace.batches()], trace.info.to_dict())
    except vmalloc.TraceFormatError as error:
        return ("error", str(error), error.record)
    finally:
        os.environ.pop("VMALLOC_PYTHON_READERS", None)
        if old is not None:
            os.environ["VMALLOC_PYTHON_READERS"] = old


def memory_event(i, addr, nbytes, device=0, device_type=1):
    return json.dumps({"ph": "i", "name": "[memory]", "ts": i,
                       "args": {"Device Type": device_type, "Device Id": device, "Addr": addr,
                                "Bytes": nbytes, "Total Allocated": 0}})


# Text around a string's end: plain ASCII, and what the 16-byte shortcut must hand on.
_PIECES = st.sampled_from(["a", "bc", "\\\"", "\\\\", "\\n", "\\u00e9", "\\u0041", "é", "€",
                           "\U0001F600", "\x01", "\x1f", "\x7f", "\t", " ", "\\q", "\\u12",
                           "\xed\xa0\x80"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lead=st.integers(0, 40), piece=_PIECES, trail=st.integers(0, 20),
       where=st.sampled_from(["key", "name", "value", "args key"]),
       block_size=st.sampled_from([1, 7, 16, 17, 1 << 20]), raw=st.booleans())
def test_strings_at_every_offset(tmp_path, monkeypatch, lead, piece, trail, where, block_size, raw):
    s = "x" * lead + piece + "y" * trail
    events = [memory_event(0, 4096, 512)]
    if where == "key":
        events.append('{"' + s + '": 1, "name": "[memory]", "ts": 1, "args": {"Device Type": 1, '
                      '"Addr": 8192, "Bytes": 256}}')
    elif where == "name":
        events.append('{"name": "' + s + '", "ts": 1, "args": {"Device Type": 1, "Addr": 1, '
                      '"Bytes": 1}}')
    elif where == "value":
        events.append('{"name": "[memory]", "cat": "' + s + '", "ts": 1, "args": {"Device Type": 1, '
                      '"Addr": 8192, "Bytes": 256}}')
    else:
        events.append('{"name": "[memory]", "ts": 1, "args": {"' + s + '": "' + s + '", '
                      '"Device Type": 1, "Addr": 8192, "Bytes": 256}}')
    text = '{"traceEvents": [' + ", ".join(events) + "]}"
    path = tmp_path / "trace.json"
    # raw: characters below 256 written as single bytes (invalid UTF-8: a lone é, an encoded
    # surrogate), else as UTF-8
    latin = all(ord(c) < 256 for c in text)
    path.write_bytes(text.encode("latin-1") if raw and latin else text.encode())
    monkeypatch.setattr(_fast, "BLOCK", block_size)
    assert outcome(path, False, format="kineto") == outcome(path, True, format="kineto")


@st.composite
def long_traces(draw):
    """Memory events among events of any length up to beyond the stitch (long strings with
    escapes, deep arrays), on two devices, with frees of memory from before the window."""
    events = [memory_event(0, 0x8000, 4096, device=0), memory_event(0, 0x8000, 4096, device=1)]
    n = draw(st.integers(1, 60))
    for i in range(n):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            length = draw(st.sampled_from([0, 15, 16, 17, STITCH - 40, STITCH, STITCH + 5000,
                                           3 * STITCH]))
            events.append(json.dumps({"ph": "X", "name": "aten::mm", "ts": i,
                                      "args": {"s": ("ab\\\"\u00e9" * length)[:length],
                                               "Input Dims": [[i, [i + 1]]] * (length // 64)}}))
        else:
            addr = 0x10000 * draw(st.integers(1, 12))
            nbytes = draw(st.sampled_from([512, -512, 4096, -4096, 0]))
            events.append(memory_event(i, addr, nbytes, device=draw(st.integers(0, 1))))
    return '{"schemaVersion": 1, "traceEvents": [\n' + ",\n".join(events) + "\n]}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=long_traces(), block_size=st.sampled_from([STITCH + 1, 20000, 40000, 70001]),
       device=st.sampled_from([0, 1, "auto"]), before_window=st.sampled_from(["drop", "live"]))
def test_events_stitched_across_large_blocks(tmp_path, monkeypatch, refuse_python, text,
                                             block_size, device, before_window):
    path = tmp_path / "trace.json"
    path.write_text(text)
    monkeypatch.setattr(_fast, "BLOCK", block_size)
    slow = outcome(path, True, format="kineto", device=device, before_window=before_window)
    with monkeypatch.context() as m:
        if slow[0] == "ok":
            refuse_python(m)
        fast = outcome(path, False, format="kineto", device=device, before_window=before_window)
    assert fast == slow


@pytest.mark.parametrize("count", [255, 256, 257, 1000])
def test_before_window_scan_in_batches(tmp_path, monkeypatch, refuse_python, count):
    """Each device's frees of memory from before the window, over more records than one batch
    of the device count's scan (device "auto": the count's scans are used): the same blocks as
    the Python reader, for the GPU and the CPU."""
    events = []
    for i in range(count):
        device_type = 0 if i % 3 == 1 else 1  # CPU, cuda:0
        addr = 0x100000 + 0x1000 * (i % 97)
        # every address first freed (before the window), then allocated and freed again
        nbytes = -512 if (i // 97) % 2 == 0 else 512
        events.append(memory_event(i, addr, nbytes, device_type=device_type))
    path = tmp_path / "trace.json"
    path.write_text('{"traceEvents": [' + ",\n".join(events) + "]}")
    for device in ("auto", "cpu", 0):
        slow = outcome(path, True, format="kineto", device=device, before_window="live")
        with monkeypatch.context() as m:
            refuse_python(m)
            fast = outcome(path, False, format="kineto", device=device, before_window="live")
        assert fast == slow
        assert fast[0] == "ok"
        assert fast[2]["frees_before_window"] > 0
