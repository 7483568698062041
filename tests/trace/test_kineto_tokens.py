"""The Kineto JSON scanner's tokens (src/trace/json_tokens.cpp, detail/json_tokens.hpp): the
integers it converts while scanning (at the 19/20-digit and 64-bit boundaries), whitespace
gaps classified sixteen bytes at a time, and values skipped without recursion (nesting up to
and past the depth limit), each with exact expected values and against the Python reader."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.traces import _fast, open_trace

pytestmark = pytest.mark.skipif(_fast._trace_parse is None, reason="built without _trace_parse")


def read(path, python, **options):
    """Events as (op, addr, size), info, or the error of reading ``path``."""
    old = os.environ.pop("VMALLOC_PYTHON_READERS", None)
    if python:
        os.environ["VMALLOC_PYTHON_READERS"] = "1"
    try:
        trace = open_trace(path, format="kineto", **options)
        events = [(int(e["op"]), int(e["addr"]), int(e["size"]))
                  for b in trace.batches() for e in b]
        return ("ok", events, trace.info.to_dict())
    except vmalloc.TraceFormatError as error:
        return ("error", str(error), error.record)
    finally:
        os.environ.pop("VMALLOC_PYTHON_READERS", None)
        if old is not None:
            os.environ["VMALLOC_PYTHON_READERS"] = old


def trace_text(events):
    return '{"traceEvents": [' + ", ".join(events) + "]}"


def memory(ts, addr, nbytes, allocated="0"):
    # the numbers as JSON text, so that the test controls every digit
    return ('{"ph": "i", "name": "[memory]", "ts": ' + ts + ', "args": {"Device Type": 1, '
            '"Device Id": 0, "Addr": ' + addr + ', "Bytes": ' + nbytes +
            ', "Total Allocated": ' + allocated + "}}")


# (Addr text, its value): 19 digits are converted as scanned, 20 with overflow checks.
ADDRS = [
    ("7", 7), ("4096", 4096), ("99999999", 99999999),
    ("139637976727552", 139637976727552),
    ("9999999999999999999", 9999999999999999999),  # 19 digits
    ("10000000000000000000", 10000000000000000000),  # 20 digits
    ("18446744073709551615", 2**64 - 1),
    ("-0", 0),  # address 0 is skipped by the normalization, as the Python reader does
]


@pytest.mark.parametrize("text,value", ADDRS)
def test_addresses_exact(tmp_path, monkeypatch, refuse_python, text, value):
    path = tmp_path / "t.json"
    path.write_text(trace_text([memory("1", text, "512"), memory("2", text, "-512")]))
    with monkeypatch.context() as m:
        refuse_python(m)
        fast = read(path, False, device=0, before_window="drop")
    if value:
        assert fast[1] == [(0, value, 512), (1, value, 512)]
    else:
        assert fast[1] == [] and fast[2]["skipped"] == {"alloc at address 0": 1,
                                                        "free of address 0": 1}
    assert fast == read(path, True, device=0, before_window="drop")


# (Bytes text, op, size)
SIZES = [
    ("1", 0, 1), ("-1", 1, 1), ("1234567890123456789", 0, 1234567890123456789),
    ("-9999999999999999999", 1, 9999999999999999999),
    ("18446744073709551615", 0, 2**64 - 1), ("-18446744073709551615", 1, 2**64 - 1),
]


@pytest.mark.parametrize("text,op,size", SIZES)
def test_sizes_exact(tmp_path, monkeypatch, refuse_python, text, op, size):
    path = tmp_path / "t.json"
    path.write_text(trace_text([memory("1", "4096", text)]))
    with monkeypatch.context() as m:
        refuse_python(m)
        fast = read(path, False, device=0, before_window="drop")
    if op == 0:
        assert fast[1] == [(0, 4096, size)]
    else:  # a free of memory the trace never allocated: dropped, its size counted
        assert fast[1] == [] and fast[2]["unmatched_free_bytes"] == size
    assert fast == read(path, True, device=0, before_window="drop")


@pytest.mark.parametrize("events", [
    [memory("1", "18446744073709551616", "512")],  # Addr 2**64: out of range
    [memory("1", "-1", "512")],
    [memory("1", "4096", "18446744073709551616")],
    [memory("1", "4096", "512", allocated="9223372036854775808")],  # beyond int64
    [memory("1", "4096", "512", allocated="-9223372036854775809")],
    [memory("1234567890123456", "4096", "512")],  # ts of 16 characters
    [memory("1.5", "4096", "512"), memory("1e0", "8192", "512"), memory("-0", "8192", "-512")],
    [memory("1", "4096", "512", allocated="-9223372036854775808"),
     memory("2", "8192", "512", allocated="9223372036854775807")],
    [memory("01", "4096", "512")],  # a leading zero: not JSON
    [memory("1", "4096", "5.12e2")],
    [memory("-", "4096", "512")],
])
def test_numbers_as_the_python_reader(tmp_path, events):
    path = tmp_path / "t.json"
    path.write_text(trace_text(events))
    for device in ("auto", 0):
        assert read(path, False, device=device) == read(path, True, device=device)


def test_counters_exact(tmp_path, monkeypatch, refuse_python):
    """Total Allocated at the ends of int64 and the time order, from numbers scanned once."""
    path = tmp_path / "t.json"
    path.write_text(trace_text([
        memory("5", "4096", "512", allocated="-9223372036854775808"),
        memory("123456789012345", "8192", "512", allocated="9223372036854775807"),
        memory("-3", "8192", "-512", allocated="0"),
    ]))
    with monkeypatch.context() as m:
        refuse_python(m)
        fast = read(path, False)
    meta = fast[2]["metadata"]
    assert meta["recorded_peak_allocated_bytes"] == 2**63 - 1
    assert meta["memory_events_out_of_time_order"] == 1
    assert fast[1] == [(0, 4096, 512), (0, 8192, 512), (1, 8192, 512)]
    assert fast == read(path, True)


_GAP = st.text(st.sampled_from(" \n\r\t"), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gaps=st.lists(_GAP, min_size=12, max_size=12), bad=st.sampled_from(["", "\x0b", "\x0c", "\x00", "\xa0"]),
       where=st.integers(0, 11), block_size=st.sampled_from([1, 7, 16, 17, 1 << 20]))
def test_whitespace_gaps(tmp_path, monkeypatch, refuse_python, gaps, bad, where, block_size):
    """Gaps of every length around every token of an event, one of them perhaps holding a
    byte that is not JSON whitespace (then the Python reader's error, as before)."""
    gaps[where] = gaps[where][: len(gaps[where]) // 2] + bad + gaps[where][len(gaps[where]) // 2:]
    g = gaps
    event = (g[0] + "{" + g[1] + '"name"' + g[2] + ":" + g[3] + '"[memory]"' + g[4] + "," + g[5]
             + '"args"' + g[6] + ":" + g[7] + '{"Device Type": 1, "Addr"' + g[8] + ":" + g[9]
             + "4096" + g[10] + ', "Bytes": 512}' + g[11] + "}")
    path = tmp_path / "t.json"
    path.write_bytes(('{"traceEvents": [' + event + ", " + memory("2", "8192", "64") + "]}")
                     .encode("latin-1"))
    monkeypatch.setattr(_fast, "BLOCK", block_size)
    slow = read(path, True, device=0)
    with monkeypatch.context() as m:
        if slow[0] == "ok":
            refuse_python(m)
            assert slow[1] == [(0, 4096, 512), (0, 8192, 64)]
        assert read(path, False, device=0) == slow


@pytest.mark.parametrize("depth", [1, 2, 50, 197, 198, 199, 200, 250])
@pytest.mark.parametrize("kind", ["[", '{"k":'])
def test_skipped_values_nested(tmp_path, depth, kind):
    """A member the reader skips, nested `depth` deep (the event and its member add two levels;
    Python's decoder stops near 200): the same events or error as the Python reader."""
    close = "]" if kind == "[" else "}"
    value = kind * depth + '[1, -2.5e3, "s", true, false, null, {}, []]' + close * depth
    event = '{"name": "aten::mm", "args": {"Input Dims": ' + value + "}}"
    path = tmp_path / "t.json"
    path.write_text(trace_text([event, memory("1", "4096", "512")]))
    fast = read(path, False, device=0)
    assert fast == read(path, True, device=0)
    if depth <= 150:
        assert fast[1] == [(0, 4096, 512)]
