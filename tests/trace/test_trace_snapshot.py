"""The PyTorch memory snapshot reader: the real shared trace's facts, PyTorch's two-step free,
ring-buffer truncation, and refusal of anything that is not plain data."""

import pickle
from pathlib import Path

import numpy as np
import pytest

import vmalloc
from vmalloc.traces import ALLOC, FREE, open_trace

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"
REAL = SHARED / "torch_snapshot_transformer_lm.pickle"
MiB = 1 << 20


def write_snapshot(path, entries, segments=(), devices=None):
    traces = devices if devices is not None else [list(entries)]
    with open(path, "wb") as f:
        pickle.dump({"segments": list(segments), "device_traces": traces}, f, protocol=4)
    return path


def e(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


def as_tuples(batch):
    return [(int(x["op"]), int(x["stream"]), int(x["addr"]), int(x["size"])) for x in batch]


@pytest.mark.skipif(not REAL.exists(), reason="shared/traces is not beside the repository")
def test_real_snapshot_facts():
    trace = open_trace(REAL)
    assert trace.format == "torch_snapshot"
    events = trace.events()
    info = trace.info
    assert info.complete
    assert info.allocs == 2162
    assert info.largest_alloc_bytes == 154389504  # 147.2 MiB
    assert info.largest_alloc_bytes // MiB == 147
    assert info.peak_live_bytes == 1999716608  # 1,907.08 MiB
    assert round(info.peak_live_bytes / MiB) == 1907
    assert info.streams == 1
    # The ring buffer lost the allocations of 222 frees: dropped and counted.
    assert info.unmatched_frees == 222
    assert info.frees == 2162 - 222
    assert len(events) == info.events == 2162 + 1940
    assert info.metadata["segment_bytes"] // MiB == 4042
    assert info.metadata["live_before_window_blocks"] == 225
    # The events agree with the counters.
    assert int(np.count_nonzero(events["op"] == ALLOC)) == 2162
    assert int(events["size"][events["op"] == ALLOC].max()) == info.largest_alloc_bytes


@pytest.mark.skipif(not REAL.exists(), reason="shared/traces is not beside the repository")
def test_real_snapshot_before_window_live():
    info = open_trace(REAL, before_window="live").scan()
    # 222 freed in the window + 225 blocks in use at the dump that the history never mentions.
    assert info.synthetic_allocs == 447
    assert info.unmatched_frees == 0
    assert info.frees == 2162
    assert info.allocs == 2162 + 447
    assert info.peak_live_bytes == 3849232640


def test_free_completed_is_the_free(tmp_path):
    path = write_snapshot(
        tmp_path / "s.pickle",
        [
            e("alloc", 0x1000, 512, stream=7),
            e("alloc", 0x2000, 1024),
            e("free_requested", 0x1000, 512, stream=7),
            e("alloc", 0x3000, 2048),  # 0x1000 is not reusable yet
            e("free_completed", 0x1000, 512, stream=7),
            e("free_requested", 0x2000, 1024),
            e("free_completed", 0x2000, 1024),
        ],
    )
    trace = open_trace(path)
    assert as_tuples(trace.events()) == [
        (ALLOC, 7, 0x1000, 512),
        (ALLOC, 0, 0x2000, 1024),
        (ALLOC, 0, 0x3000, 2048),
        (FREE, 7, 0x1000, 512),
        (FREE, 0, 0x2000, 1024),
    ]
    assert trace.info.peak_live_bytes == 512 + 1024 + 2048
    assert trace.info.live_at_end == 1


def test_free_requested_counts_when_no_completion_follows(tmp_path):
    # Recorded with skip_actions=["free_completed"], or cut off before the completion.
    path = write_snapshot(
        tmp_path / "s.pickle",
        [
            e("alloc", 0x1000, 512),
            e("free_requested", 0x1000, 512),
            e("alloc", 0x1000, 512),  # reused: the earlier request was the free
            e("free_requested", 0x1000, 512),
            e("free_completed", 0x1000, 512),
            e("alloc", 0x2000, 64),
            e("free_requested", 0x2000, 64),  # the trace ends before completion
        ],
    )
    assert as_tuples(open_trace(path).events()) == [
        (ALLOC, 0, 0x1000, 512),
        (FREE, 0, 0x1000, 512),
        (ALLOC, 0, 0x1000, 512),
        (FREE, 0, 0x1000, 512),
        (ALLOC, 0, 0x2000, 64),
        (FREE, 0, 0x2000, 64),
    ]


def test_truncated_window_drop_and_live(tmp_path):
    segments = [
        {
            "device": 0,
            "address": 0x10000,
            "total_size": 1 << 20,
            "stream": 3,
            "blocks": [
                {"address": 0x10000, "size": 4096, "requested_size": 4000, "state": "active_allocated"},
                {"address": 0x11000, "size": 8192, "requested_size": 8192, "state": "inactive"},
                {"address": 0x20000, "size": 512, "requested_size": 512, "state": "active_allocated"},
            ],
        }
    ]
    entries = [
        e("free_completed", 0x5000, 300),  # its alloc fell out of the ring buffer
        e("alloc", 0x20000, 512),  # live at the dump, but allocated in the window
        e("oom", 0, 1 << 40),
        e("segment_alloc", 0x10000, 1 << 20),
    ]
    path = write_snapshot(tmp_path / "s.pickle", entries, segments)

    dropped = open_trace(path)
    assert as_tuples(dropped.events()) == [(ALLOC, 0, 0x20000, 512)]
    info = dropped.info
    assert (info.unmatched_frees, info.unmatched_free_bytes) == (1, 300)
    assert info.skipped == {"oom": 1, "segment_alloc": 1}
    assert info.metadata["live_before_window_blocks"] == 1
    assert info.metadata["live_before_window_bytes"] == 4000
    assert info.metadata["segment_bytes"] == 1 << 20

    live = open_trace(path, before_window="live")
    assert as_tuples(live.events()) == [
        (ALLOC, 0, 0x5000, 300),  # freed in the window: live before it
        (ALLOC, 3, 0x10000, 4000),  # in use at the dump, never mentioned: live throughout
        (FREE, 0, 0x5000, 300),
        (ALLOC, 0, 0x20000, 512),
    ]
    assert (live.info.synthetic_allocs, live.info.synthetic_alloc_bytes) == (2, 4300)
    assert live.info.unmatched_frees == 0


def test_devices(tmp_path):
    path = write_snapshot(
        tmp_path / "s.pickle", (), devices=[[e("alloc", 0x1000, 8)], [e("alloc", 0x9000, 16)]]
    )
    assert as_tuples(open_trace(path, device=1).events()) == [(ALLOC, 0, 0x9000, 16)]
    assert as_tuples(open_trace(path, device="cuda:0").events()) == [(ALLOC, 0, 0x1000, 8)]
    with pytest.raises(vmalloc.TraceFormatError, match="no device 2: it records devices 0..1"):
        open_trace(path, device=2)
    with pytest.raises(vmalloc.InvalidArgumentError, match="CUDA devices only"):
        open_trace(path, device="cpu")


def test_snapshot_without_history(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(vmalloc.TraceFormatError, match="_record_memory_history") as error:
        open_trace(path)
    assert error.value.path == str(path)
    assert error.value.record is None


def test_bad_entry_names_its_record(tmp_path):
    path = write_snapshot(
        tmp_path / "s.pickle", [e("alloc", 0x1000, 8), e("alloc", "0x2000", 8)]
    )
    with pytest.raises(vmalloc.TraceFormatError, match=r"'addr' must be an integer") as error:
        open_trace(path).scan()
    assert error.value.record == 2
    assert str(error.value).startswith(f"{path}:2: ")


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_with_a_class_is_refused_not_run(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[]], "x": _Evil()}))
    with pytest.raises(vmalloc.TraceFormatError, match="refusing to load"):
        open_trace(path, format="torch_snapshot")


def test_not_a_pickle(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(vmalloc.TraceFormatError, match="cannot unpickle"):
        open_trace(path)
