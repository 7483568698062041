""".vmtrace, vmalloc's own format: exact bytes of the header and records, round trips in both
encodings, corruption detection, convert() and the shipped trace."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.traces import (
    ALLOC,
    EVENT_DTYPE,
    FREE,
    VmtraceWriter,
    builtin_traces,
    convert,
    open_trace,
)
from vmalloc.traces import _normalize, vmtrace

SHARED_SNAPSHOT = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "torch_snapshot_transformer_lm.pickle"
)
KINETO_FIXTURE = Path(__file__).resolve().parents[1] / "data" / "profiler_cpu_mlp.json"


def batch_of(rows):
    batch = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, (op, stream, addr, size) in enumerate(rows):
        batch[i] = (op, stream, addr, size)
    return batch


def as_tuples(batch):
    return [(int(x["op"]), int(x["stream"]), int(x["addr"]), int(x["size"])) for x in batch]


ROWS = [(ALLOC, 0, 0x7F0000000000, 4096), (ALLOC, 9, 0x7F0000200000, 1 << 30),
        (FREE, 0, 0x7F0000000000, 4096), (FREE, 9, 0x7F0000200000, 1 << 30)]


def test_raw_layout_is_exact(tmp_path):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, encoding="raw", consistent=True, metadata={"k": "v"}) as w:
        w.write(batch_of(ROWS[:1]))
    data = path.read_bytes()
    meta = b'{"k": "v"}'
    assert data[:32] == struct.pack("<8sHHIQII", b"VMTRACE\0", 1, 0, 1, 1, len(meta), 0)
    assert data[32 : 32 + len(meta)] == meta
    record = data[32 + len(meta) :]
    assert record == struct.pack("<B7xQQQ", ALLOC, 0, 0x7F0000000000, 4096)


@pytest.mark.parametrize("encoding", ["raw", "zlib"])
def test_round_trip(tmp_path, encoding):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, encoding=encoding, consistent=True) as w:
        w.write(batch_of(ROWS[:3]))
        w.write(batch_of(ROWS[3:]))
        assert w.events_written == 4
    trace = open_trace(path)
    assert trace.format == "vmtrace"
    assert trace.info.events == 4  # known from the header before reading
    assert as_tuples(trace.events()) == ROWS
    info = trace.info
    assert (info.allocs, info.frees, info.streams) == (2, 2, 2)
    assert info.peak_live_bytes == 4096 + (1 << 30)
    assert info.largest_alloc_bytes == 1 << 30
    assert (info.live_at_end, info.live_at_end_bytes) == (0, 0)
    assert info.metadata["encoding"] == encoding


events_strategy = st.lists(
    st.tuples(
        st.sampled_from([ALLOC, FREE]),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
    ),
    max_size=300,
)


@settings(max_examples=40, deadline=None)
@given(rows=events_strategy, encoding=st.sampled_from(["raw", "zlib"]), split=st.integers(0, 300))
def test_round_trip_any_events(tmp_path_factory, rows, encoding, split):
    path = tmp_path_factory.mktemp("rt") / "t.vmtrace"
    with VmtraceWriter(path, encoding=encoding) as w:
        w.write(batch_of(rows[:split]))
        w.write(batch_of(rows[split:]))
    # Not marked consistent: read back through the normalizer, raw records are as written.
    reader = vmtrace.VmtraceReader(str(path), "cuda", 0)
    got = [row for batch in reader.raw_batches() for row in as_tuples(batch)]
    assert got == rows


def test_blocks_hold_at_most_block_events(tmp_path, monkeypatch):
    monkeypatch.setattr(vmtrace, "BLOCK_EVENTS", 3)
    path = tmp_path / "t.vmtrace"
    rows = [(ALLOC, 0, 0x1000 * (i + 1), i + 1) for i in range(8)]
    with VmtraceWriter(path, consistent=True) as w:
        for row in rows:
            w.write(batch_of([row]))
    data = path.read_bytes()
    assert data.count(b"VMTB") == 3  # 3 + 3 + 2 events
    assert as_tuples(open_trace(path).events()) == rows


def test_unknown_count_reads_to_the_end(tmp_path):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, encoding="raw", consistent=True) as w:
        w.write(batch_of(ROWS))
    data = bytearray(path.read_bytes())
    data[16:24] = b"\xff" * 8  # as left by a writer that could not seek back
    path.write_bytes(bytes(data))
    trace = open_trace(path)
    assert trace.info.events is None
    assert as_tuples(trace.events()) == ROWS
    assert trace.info.events == 4


def test_inconsistent_file_is_normalized(tmp_path):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, encoding="raw") as w:  # not promised consistent
        w.write(batch_of([(FREE, 0, 0x50, 8), (ALLOC, 0, 0x60, 16), (FREE, 0, 0x60, 0)]))
    trace = open_trace(path)
    assert as_tuples(trace.events()) == [(ALLOC, 0, 0x60, 16), (FREE, 0, 0x60, 16)]
    assert trace.info.unmatched_frees == 1


def _raw_file(tmp_path, rows=ROWS):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, encoding="raw", consistent=True) as w:
        w.write(batch_of(rows))
    return path, bytearray(path.read_bytes())


@pytest.mark.parametrize(
    "mutate, message, record",
    [
        (lambda d: d.__setitem__(slice(0, 8), b"VMTRACX\0"), "not a .vmtrace file", None),
        (lambda d: d.__setitem__(slice(8, 10), b"\x02\x00"), "version 2 is not supported", None),
        (lambda d: d.__setitem__(slice(10, 12), b"\x07\x00"), "unknown .vmtrace encoding 7", None),
        (lambda d: d.__setitem__(slice(12, 16), b"\x03\x00\x00\x00"), "unknown .vmtrace flags", None),
        (lambda d: d.__setitem__(32 + 2 * 32, 5), "event 3 has op 5", 3),
        (lambda d: d.__delitem__(slice(len(d) - 1, len(d))), "ends inside event record 4", 4),
        (lambda d: d.__delitem__(slice(len(d) - 32, len(d))), "truncated: 3 events", 4),
        (lambda d: d.extend(bytes(32)), "more events than the 4", 5),
    ],
)
def test_corruption_is_reported(tmp_path, mutate, message, record):
    path, data = _raw_file(tmp_path)
    mutate(data)
    path.write_bytes(bytes(data))
    with pytest.raises(vmalloc.TraceFormatError, match=message) as error:
        open_trace(path, format="vmtrace").scan()
    assert error.value.record == record


def test_corrupt_block_is_reported(tmp_path):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, consistent=True) as w:
        w.write(batch_of(ROWS))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the zlib stream
    path.write_bytes(bytes(data))
    with pytest.raises(vmalloc.TraceFormatError, match="block 1 is corrupt") as error:
        open_trace(path).scan()
    assert error.value.record == 1


def test_writer_rejects_bad_batches(tmp_path):
    with VmtraceWriter(tmp_path / "t.vmtrace") as w:
        with pytest.raises(vmalloc.InvalidArgumentError, match="EVENT_DTYPE"):
            w.write(np.zeros(3, dtype=np.uint64))
        bad = batch_of([(ALLOC, 0, 1, 1)])
        bad["op"] = 2
        with pytest.raises(vmalloc.InvalidArgumentError, match="op other than"):
            w.write(bad)
        assert w.events_written == 0
    with pytest.raises(vmalloc.InvalidArgumentError, match="encoding"):
        VmtraceWriter(tmp_path / "u.vmtrace", encoding="lz4")


@pytest.mark.skipif(not SHARED_SNAPSHOT.exists(), reason="shared/traces is not beside the repository")
@pytest.mark.parametrize("encoding", ["raw", "zlib"])
def test_convert_snapshot(tmp_path, encoding):
    dst = tmp_path / "lm.vmtrace"
    info = convert(SHARED_SNAPSHOT, dst, encoding=encoding)
    assert info.allocs == 2162
    converted = open_trace(dst)
    assert converted.info.metadata["source_format"] == "torch_snapshot"
    assert converted.info.metadata["consistent"] is True
    original = open_trace(SHARED_SNAPSHOT).events()
    assert np.array_equal(converted.events(), original)
    assert converted.info.peak_live_bytes == info.peak_live_bytes == 1999716608
    if encoding == "zlib":
        assert dst.stat().st_size < 8000  # 4,102 events in under 2 bytes each


def test_convert_kineto_and_rmm(tmp_path):
    dst = tmp_path / "k.vmtrace"
    info = convert(KINETO_FIXTURE, dst, device="cpu")
    assert info.events == 91
    assert np.array_equal(open_trace(dst).events(), open_trace(KINETO_FIXTURE, device="cpu").events())
    csv = tmp_path / "log.csv"
    csv.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,8,0\n1,t,free,0x10,8,0\n")
    convert(csv, tmp_path / "r.vmtrace")
    assert as_tuples(open_trace(tmp_path / "r.vmtrace").events()) == [(ALLOC, 0, 0x10, 8), (FREE, 0, 0x10, 8)]


def test_failed_convert_leaves_no_file(tmp_path):
    csv = tmp_path / "log.csv"
    csv.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,8,0\n1,t,boom,0,0,0\n")
    dst = tmp_path / "out.vmtrace"
    with pytest.raises(vmalloc.TraceFormatError, match="unknown action"):
        convert(csv, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv"]
    with pytest.raises(vmalloc.InvalidArgumentError, match="is the source"):
        convert(csv, csv)


def test_builtin_trace():
    traces = builtin_traces()
    assert list(traces) == ["transformer_lm_cpu"]
    path = Path(traces["transformer_lm_cpu"])
    assert path.stat().st_size < 1 << 20
    trace = open_trace(path)
    assert trace.info.events == 12596  # from the header
    info = trace.scan()
    # Facts of the recorded run (benchmarks/record_trace.py: 6 AdamW steps of a 4-layer
    # Transformer LM, batch 16 x 128 tokens, vocabulary 8,000, on the CPU).
    assert (info.allocs, info.frees) == (6298, 6298)
    assert info.largest_alloc_bytes == 16 * 128 * 8000 * 4  # the logits
    assert info.peak_live_bytes == 603596888
    assert info.metadata["source_format"] == "kineto"
    assert info.metadata["consistent"] is True


def test_batches_never_exceed_batch_events(tmp_path, monkeypatch):
    monkeypatch.setattr(_normalize, "BATCH_EVENTS", 5)
    csv = tmp_path / "log.csv"
    lines = ["Thread,Time,Action,Pointer,Size,Stream"]
    for i in range(7):
        lines.append(f"1,t,allocate,{0x100 + i:#x},8,0")
    lines.append("1,t,allocate,0x100,8,0")  # implicit free + alloc: two events at once
    csv.write_text("\n".join(lines) + "\n")
    sizes = [len(b) for b in open_trace(csv).batches()]
    assert sizes == [5, 4]
    assert max(sizes) <= 5
    meta = json.loads(json.dumps(open_trace(csv).info.to_dict()))
    assert meta["format"] == "rmm_csv"
