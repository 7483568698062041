"""Profiler traces that start mid-job: memory live before the first event is allocated at the
start (from PyTorch's Total Allocated counter and the frees of addresses never allocated), and
PyTorch's own reserved peak (Total Reserved) is reported next to the replayed allocators."""

import json

import pytest

from vmalloc.cli import main
from vmalloc.replay import replay
from vmalloc.traces import open_trace
from vmalloc.traces.kineto import LIVE_BEFORE_ADDR

GiB = 1 << 30
MiB = 1 << 20


def mid_job_trace(path, totals=True):
    """5 GiB allocated before the first event: 1 GiB freed in the window at 0x2000000000, 4 GiB
    (weights) live throughout and never mentioned. PyTorch reserved 8 GiB."""
    events = []
    total = 5 * GiB

    def m(addr, n):
        nonlocal total
        total += n
        args = {"Addr": addr, "Bytes": n, "Device Type": 1, "Device Id": 0}
        if totals:
            args.update({"Total Allocated": total, "Total Reserved": 8 * GiB})
        events.append({"ph": "i", "name": "[memory]", "ts": len(events), "args": args})

    m(0x1000000000, 512 * MiB)
    m(0x2000000000, -GiB)
    m(0x1000000000, -512 * MiB)
    m(0x3000000000, 2 * GiB)
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_live_before_the_window_is_the_default(tmp_path):
    trace = open_trace(mid_job_trace(tmp_path / "t.json"))
    assert trace.before_window == "live"
    info = trace.scan()
    assert info.metadata["allocated_before_window_bytes"] == 5 * GiB
    assert info.metadata["recorded_peak_allocated_bytes"] == 6 * GiB
    assert info.metadata["recorded_peak_reserved_bytes"] == 8 * GiB
    assert (info.synthetic_allocs, info.synthetic_alloc_bytes) == (2, 5 * GiB)
    assert (info.frees_before_window, info.free_before_window_bytes) == (1, GiB)
    assert info.unmatched_frees == 0
    assert info.peak_live_bytes == 6 * GiB  # the same peak PyTorch's counter recorded
    events = trace.events()
    # First the synthetic allocations: the freed 1 GiB, then the 4 GiB no event mentions.
    assert [(int(e["addr"]), int(e["size"])) for e in events[:2]] == [
        (0x2000000000, GiB), (LIVE_BEFORE_ADDR, 4 * GiB)]


def test_drop_still_counts_the_unmatched_frees(tmp_path):
    info = open_trace(mid_job_trace(tmp_path / "t.json"), before_window="drop").scan()
    assert (info.unmatched_frees, info.unmatched_free_bytes) == (1, GiB)
    assert info.synthetic_allocs == 0
    assert info.peak_live_bytes == 2 * GiB


def test_results_carry_pytorchs_reserved_and_the_unmatched_frees(tmp_path):
    path = mid_job_trace(tmp_path / "t.json")
    results = replay(str(path), min_capacity=False)
    for r in results:
        assert r.peak_requested_bytes == 6 * GiB
        assert r.recorded_peak_reserved_bytes == 8 * GiB
        assert r.recorded_peak_allocated_bytes == 6 * GiB
        assert (r.unmatched_frees, r.unmatched_free_bytes) == (1, GiB)
        assert r.live_before_window_bytes == 5 * GiB
        assert r.before_window == "live"
    dropped = replay(str(path), ["caching"], min_capacity=False, before_window="drop")[0]
    assert dropped.peak_requested_bytes == 2 * GiB
    assert (dropped.unmatched_frees, dropped.live_before_window_bytes) == (1, 0)


def test_table_json_and_warning(tmp_path, capsys):
    path = mid_job_trace(tmp_path / "t.json")
    assert main(["replay", str(path), "--no-min-capacity"]) == 0
    out, err = capsys.readouterr()
    header = out.splitlines()[1].split()
    assert header[-2:] == ["pytorch", "(recorded)"]
    reserved = next(line for line in out.splitlines() if "peak reserved" in line)
    assert reserved.split()[-2:] == ["8.00", "GiB"]
    utilization = next(line for line in out.splitlines() if line.strip().startswith("utilization"))
    assert utilization.split()[-1] == "0.750"
    assert ("frees of memory the trace never allocated: 1 (1.00 GiB); 5.00 GiB live before the "
            "trace began") in out
    assert "vmalloc replay: warning: t: frees of memory the trace never allocated: 1 (1.00 GiB)" in err
    assert main(["replay", str(path), "--no-min-capacity", "--json",
                 "--before-window", "drop"]) == 0
    out, err = capsys.readouterr()
    for r in json.loads(out):
        assert r["unmatched_frees"] == 1 and r["unmatched_free_bytes"] == GiB
        assert r["recorded_peak_reserved_bytes"] == 8 * GiB
        assert r["live_before_window_bytes"] == 0
    assert "dropped (--before-window live" in err


def test_without_counters_no_recorded_column(tmp_path, capsys):
    path = mid_job_trace(tmp_path / "t.json", totals=False)
    info = open_trace(path).scan()
    assert info.metadata["recorded_peak_reserved_bytes"] is None
    assert (info.synthetic_allocs, info.synthetic_alloc_bytes) == (1, GiB)  # the free's only
    assert main(["replay", str(path), "--no-min-capacity"]) == 0
    out, _ = capsys.readouterr()
    assert "pytorch (recorded)" not in out


@pytest.mark.parametrize("before_window", ["live", "drop"])
def test_trace_with_nothing_before_reports_zero(tmp_path, before_window):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "i", "name": "[memory]", "args": {"Addr": 16, "Bytes": 512, "Device Type": 1,
                                                 "Device Id": 0, "Total Allocated": 512,
                                                 "Total Reserved": 2 * MiB}}]}))
    [r] = replay(str(path), ["caching"], min_capacity=False, before_window=before_window)
    assert (r.unmatched_frees, r.unmatched_free_bytes, r.live_before_window_bytes) == (0, 0, 0)
    assert r.recorded_peak_reserved_bytes == 2 * MiB


def test_side_by_side_shows_pytorchs_reserved(tmp_path, capsys):
    a = mid_job_trace(tmp_path / "rank0.json")
    b = mid_job_trace(tmp_path / "rank1.json")
    assert main(["replay", str(a), str(b), "--no-min-capacity", "-a", "caching"]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("side by side"):].splitlines()
    assert "pytorch reserved (util.)" in summary[1]
    assert summary[2].split()[-3:] == ["8.00", "GiB", "(0.750)"]
