"""PyTorch users' habits (issue 17, item 3): ``vmalloc.torch.memory_summary()``,
``vmalloc.torch.memory_snapshot()`` and ``vmalloc convert --to torch-snapshot``, whose file is
what ``torch.cuda.memory._dump_snapshot`` writes: read back by vmalloc's own snapshot reader
(the same events) and by PyTorch's ``torch.cuda._memory_viz``, with the documented fields."""

import pickle

import numpy as np
import pytest

import vmalloc
import vmalloc.torch as vtorch
from vmalloc.cli import main
from vmalloc.traces import VmtraceWriter, builtin_traces, open_trace
from vmalloc.traces.events import ALLOC, EVENT_DTYPE, FREE
from vmalloc.traces.torch_export import (allocator_snapshot, snapshot_from_events,
                                         snapshot_from_trace, write_snapshot)

MiB = 1 << 20
# The fields torch.cuda.memory._snapshot documents (Segment, Block, TraceEntry).
SEGMENT_FIELDS = {"address", "total_size", "stream", "segment_type", "segment_pool_id",
                  "allocated_size", "active_size", "blocks", "device"}
BLOCK_FIELDS = {"size", "requested_size", "address", "state", "frames"}
ENTRY_FIELDS = {"action", "addr", "size", "stream", "frames"}


def _events(rows):
    events = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, row in enumerate(rows):
        events[i] = row
    return events


ROWS = [(ALLOC, 0, 0x1000, 3 * MiB), (ALLOC, 7, 0x900000, 700), (FREE, 0, 0x1000, 3 * MiB),
        (ALLOC, 0, 0x1000, 12 * MiB), (FREE, 7, 0x900000, 700)]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "job.vmtrace"
    with VmtraceWriter(path, consistent=True) as writer:
        writer.write(_events(ROWS))
    return path


def _fields(events):
    return [tuple(int(x) for x in e) for e in events[["op", "stream", "addr", "size"]]]


def test_the_history_and_the_live_blocks_in_the_documented_fields():
    snap = snapshot_from_events(_events(ROWS), device=2)
    assert set(snap) == {"segments", "device_traces"}
    assert snap["device_traces"][:2] == [[], []]
    history = snap["device_traces"][2]
    assert [(e["action"], e["addr"], e["size"], e["stream"]) for e in history] == [
        ("alloc", 0x1000, 3 * MiB, 0), ("alloc", 0x900000, 700, 7),
        ("free_requested", 0x1000, 3 * MiB, 0), ("free_completed", 0x1000, 3 * MiB, 0),
        ("alloc", 0x1000, 12 * MiB, 0),
        ("free_requested", 0x900000, 700, 7), ("free_completed", 0x900000, 700, 7)]
    assert all(set(e) == ENTRY_FIELDS and e["frames"] == [] for e in history)
    (segment,) = snap["segments"]   # the 12 MiB block, live at the end
    assert set(segment) == SEGMENT_FIELDS
    assert segment == {"address": 0x1000, "total_size": 12 * MiB, "stream": 0,
                       "segment_type": "large", "segment_pool_id": (0, 0),
                       "allocated_size": 12 * MiB, "active_size": 12 * MiB, "device": 2,
                       "blocks": [{"address": 0x1000, "size": 12 * MiB,
                                   "requested_size": 12 * MiB, "state": "active_allocated",
                                   "frames": []}]}
    assert set(segment["blocks"][0]) == BLOCK_FIELDS


def test_round_trip_through_vmalloc_snapshot_reader_gives_the_same_events(trace_file,
                                                                        tmp_path):
    out = write_snapshot(snapshot_from_trace(trace_file), tmp_path / "job.pickle")
    back = open_trace(out)
    assert back.format == "torch_snapshot"
    assert _fields(back.events()) == _fields(open_trace(trace_file).events()) == [
        tuple(r) for r in ROWS]


def test_round_trip_of_the_shipped_trace(tmp_path):
    src = builtin_traces()["transformer_lm_cpu"]
    out = tmp_path / "t.pickle"
    assert main(["convert", "--to", "torch-snapshot", src, str(out)]) == 0
    assert _fields(open_trace(out).events()) == _fields(open_trace(src).events())
    snap = pickle.loads(out.read_bytes())
    assert len(snap["device_traces"][0]) == 18_894   # 6,298 allocs, 6,298 frees in 2 steps


def test_pytorch_memory_viz_reads_it(trace_file):
    viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = snapshot_from_trace(trace_file)
    assert "7 entries" in viz.trace(snap)
    assert "segments: 1" in viz.segsum(snap)
    assert "total_allocated: 12.0MiB" in viz.segsum(snap)
    assert viz.segments(snap, format_flamegraph=lambda text: text).strip()
    assert "Active Memory Timeline" in viz.trace_plot(snap)


def test_vmalloc_torch_memory_snapshot_and_summary_of_the_current_allocator(tmp_path):
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    log = vmalloc.LoggingAllocator(vmalloc.VirtualAllocator(dev, chunk_size="2MiB"),
                                   str(tmp_path / "job.vmtrace"))
    previous = vmalloc.set_current_allocator(log, 0)
    try:
        p = log.allocate(3 * MiB)
        q = log.allocate(100)
        log.deallocate(p)
        snap = vtorch.memory_snapshot()
        assert [(e["action"], e["size"]) for e in snap["device_traces"][0]] == [
            ("alloc", 3 * MiB), ("alloc", 100), ("free_requested", 3 * MiB),
            ("free_completed", 3 * MiB)]
        assert [(s["address"], s["total_size"]) for s in snap["segments"]] == [(q, 100)]
        summary = vtorch.memory_summary("cuda:0")
        lines = summary.splitlines()
        assert "vmalloc memory summary, device 0" in lines[1]
        assert "utilization (peak requested / peak reserved): 0.500" in lines[2]
        assert "| Requested memory         |        100 B |     3.00 MiB |            - |" in lines
        assert "| Reserved memory          |     6.00 MiB |     6.00 MiB |            - |" in lines
        assert "| Allocations              |            1 |            2 |            2 |" in lines
        assert "| Frees                    |            - |            - |            1 |" in lines
        assert len({len(line) for line in lines}) == 1   # a rectangle
        log.deallocate(q)
    finally:
        vmalloc.set_current_allocator(previous, 0)
        log.close()


def test_memory_snapshot_of_an_allocator_without_history_says_what_to_do():
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    with pytest.raises(vmalloc.InvalidArgumentError, match="wrap it in vmalloc.LoggingAllocator"):
        allocator_snapshot(vmalloc.VirtualAllocator(dev))


def test_convert_to_torch_snapshot_errors_are_one_line(capsys, tmp_path):
    code = main(["convert", "--to", "torch-snapshot", str(tmp_path / "none.vmtrace"),
                 str(tmp_path / "x.pickle")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vmalloc convert: error: ") and err.count("\n") == 1
    assert not (tmp_path / "x.pickle").exists()
