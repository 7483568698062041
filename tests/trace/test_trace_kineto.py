"""The PyTorch profiler (Kineto chrome-trace JSON) reader: a real CPU profiler trace, device
selection, streaming across buffer boundaries, gzip, and errors that name the line."""

import gzip
import json
from pathlib import Path

import pytest

import vmalloc
from vmalloc.traces import ALLOC, FREE, open_trace, trace_devices
from vmalloc.traces import _json_stream

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "profiler_cpu_mlp.json"


def memory_event(addr, nbytes, device_type=1, device_id=0, ts=0):
    return {
        "ph": "i",
        "cat": "cpu_instant_event",
        "s": "t",
        "name": "[memory]",
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "args": {
            "Total Reserved": 0,
            "Total Allocated": 0,
            "Bytes": nbytes,
            "Device Id": device_id,
            "Device Type": device_type,
            "Addr": addr,
        },
    }


def op_event(name="aten::mm"):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": 0, "dur": 3,
            "args": {"External id": 5, "Input Dims": [[2, 3], [3, 4]]}}


def write_trace(path, events, indent=1, **top):
    document = {"schemaVersion": 1, "deviceProperties": [], **top, "traceEvents": events,
                "traceName": "x"}
    Path(path).write_text(json.dumps(document, indent=indent))
    return path


def as_tuples(batch):
    return [(int(x["op"]), int(x["stream"]), int(x["addr"]), int(x["size"])) for x in batch]


def expected_from_json(path, device_type):
    """The events a Kineto trace holds for a device type, computed with json.load."""
    with open(path) as f:
        document = json.load(f)
    out = []
    for event in document["traceEvents"]:
        if event.get("name") == "[memory]" and event["args"]["Device Type"] == device_type:
            nbytes = event["args"]["Bytes"]
            op = ALLOC if nbytes > 0 else FREE
            out.append((op, 0, event["args"]["Addr"], abs(nbytes)))
    return out


def test_real_cpu_profiler_trace():
    trace = open_trace(FIXTURE, device="cpu")
    assert trace.format == "kineto"
    events = as_tuples(trace.events())
    # The fixture is self-contained (the model is built inside the profiled window), so the
    # events are exactly the [memory] events in file order.
    assert events == expected_from_json(FIXTURE, device_type=0)
    info = trace.info
    assert (info.events, info.allocs, info.frees) == (91, 50, 41)
    assert info.unmatched_frees == 0
    assert info.device == "cpu"
    assert info.metadata["memory_events_by_device"] == {"cpu": 91}
    assert info.metadata["schemaVersion"] == 1


def test_cpu_trace_asked_for_cuda_says_so():
    # No advice in Python syntax (the command line gives its own, with its flags).
    with pytest.raises(vmalloc.TraceFormatError, match=r"no GPU memory events, only events for cpu$"):
        open_trace(FIXTURE).scan()
    with pytest.raises(vmalloc.TraceFormatError, match=r"device cuda:0; the trace has events for cpu$"):
        open_trace(FIXTURE, device=0).scan()


def test_profiler_trace_made_now_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.ones(1000, 100)
        b = (a @ a.T).sum(dim=0)
        del a
        c = b * 2
    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    del b, c
    expected = expected_from_json(path, device_type=0)
    assert expected, "torch recorded no [memory] events"
    # 400 kB of ones: the largest request (sizes of the others depend on torch's kernels).
    assert max(size for op, _, _, size in expected if op == ALLOC) >= 400000
    trace = open_trace(path, device="cpu", before_window="drop")
    # Frees of memory allocated before profiling began are dropped; nothing else changes.
    assert as_tuples(trace.events()) == _without_unmatched_frees(expected)


def _without_unmatched_frees(events):
    live = set()
    kept = []
    for op, stream, addr, size in events:
        if op == ALLOC:
            live.add(addr)
        elif addr in live:
            live.discard(addr)
        else:
            continue
        kept.append((op, stream, addr, size))
    return kept


def test_device_selection(tmp_path):
    path = write_trace(
        tmp_path / "t.json",
        [
            op_event(),
            memory_event(0x1000, 512, device_type=1, device_id=0),
            memory_event(0x2000, 256, device_type=1, device_id=1),
            memory_event(0x3000, 64, device_type=0, device_id=-1),
            memory_event(0x1000, -512, device_type=1, device_id=0),
            {"ph": "i", "name": "[OutOfMemory]", "args": {"Device Type": 1, "Device Id": 0}},
        ],
    )
    with pytest.raises(vmalloc.TraceFormatError, match=r"several GPU devices \(cuda:0, cuda:1\)"):
        open_trace(path)
    assert trace_devices(path) == {"cpu": 1, "cuda:0": 2, "cuda:1": 1}
    cuda0 = open_trace(path, device=0)
    assert as_tuples(cuda0.events()) == [(ALLOC, 0, 0x1000, 512), (FREE, 0, 0x1000, 512)]
    assert cuda0.info.metadata["memory_events_by_device"] == {"cpu": 1, "cuda:0": 2, "cuda:1": 1}
    assert cuda0.info.skipped == {"oom": 1}
    assert open_trace(path, device=0, before_window="live").scan().skipped == {"oom": 1}
    assert as_tuples(open_trace(path, device="cuda:1").events()) == [(ALLOC, 0, 0x2000, 256)]
    assert as_tuples(open_trace(path, device="cpu").events()) == [(ALLOC, 0, 0x3000, 64)]
    with pytest.raises(vmalloc.TraceFormatError, match="no memory events for device cuda:2"):
        open_trace(path, device=2).scan()


def test_array_format_and_gzip(tmp_path):
    events = [memory_event(0x10, 100), op_event(), memory_event(0x10, -100)]
    plain = tmp_path / "a.json"
    plain.write_text(json.dumps(events))
    assert as_tuples(open_trace(plain).events()) == [(ALLOC, 0, 0x10, 100), (FREE, 0, 0x10, 100)]
    packed = tmp_path / "t.pt.trace.json.gz"
    packed.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    trace = open_trace(packed)
    assert trace.format == "kineto"
    assert as_tuples(trace.events()) == [(ALLOC, 0, 0x10, 100), (FREE, 0, 0x10, 100)]


def test_streams_across_tiny_buffers(tmp_path, monkeypatch):
    events = []
    for i in range(40):
        events += [op_event("x" * (i % 7)), memory_event(0x1000 + i, 10 + i, ts=i)]
    for i in range(40):
        events.append(memory_event(0x1000 + i, -(10 + i), ts=100 + i))
    path = write_trace(tmp_path / "t.json", events, indent=None, big=12345678901234567890)
    expected = expected_from_json(path, device_type=1)
    monkeypatch.setattr(_json_stream, "_CHUNK", 7)  # every value straddles buffer ends
    trace = open_trace(path)
    assert as_tuples(trace.events()) == expected
    assert trace.info.metadata["big"] == 12345678901234567890
    assert trace.info.peak_live_bytes == sum(10 + i for i in range(40))


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "t.json"
    good = json.dumps({"traceEvents": [memory_event(0x10, 100)]}, indent=1)
    lines = good.splitlines()
    # Break the value of "Bytes" (line numbers are 1-based).
    n = next(i for i, line in enumerate(lines) if '"Bytes"' in line)
    lines[n] = lines[n].replace("100", "1oo")
    path.write_text("\n".join(lines))
    with pytest.raises(vmalloc.TraceFormatError, match="invalid JSON") as error:
        open_trace(path).scan()
    assert error.value.record == n + 1
    assert error.value.path == str(path)


def test_bad_field_names_the_line(tmp_path):
    event = memory_event(0x10, 100)
    event["args"]["Addr"] = "0x10"
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [\n' + json.dumps(op_event()) + ",\n" + json.dumps(event) + "\n]}")
    with pytest.raises(vmalloc.TraceFormatError, match="'Addr' must be an integer") as error:
        open_trace(path).scan()
    assert error.value.record == 3


def test_trace_without_memory_events(tmp_path):
    path = write_trace(tmp_path / "t.json", [op_event()])
    with pytest.raises(vmalloc.TraceFormatError, match="profile_memory=True"):
        open_trace(path).scan()


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"traceEvents": [', "invalid JSON"),
        ('{"traceEvents": []', "expected ',' or '}'"),
        ('{"other": 1}', "no 'traceEvents'"),
        ('{"traceEvents": [1]}', "not a JSON object"),
        ('{"traceEvents": []} x', "unexpected data"),
        ("", "expected a JSON object or array, found end of file"),
    ],
)
def test_malformed(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(vmalloc.TraceFormatError, match=message):
        open_trace(path).scan()
