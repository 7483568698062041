"""Smaller defects of the replay command line, each pinned: convert writes the format the
destination names, --plot honours its suffix, the help names every allocator, a run stopped at
its first event has no utilization, and reading a trace is not charged to one allocator."""

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

from vmalloc.cli import main
from vmalloc.replay import ALLOCATOR_KINDS, format_table, replay
from vmalloc.traces import EVENT_DTYPE, open_trace
from vmalloc.traces.events import ALLOC, FREE

MiB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def snapshot(tmp_path):
    entries = [{"action": "alloc", "addr": 0x1000, "size": 3 * MiB, "stream": 0},
               {"action": "alloc", "addr": 0x9000000, "size": 700, "stream": 7},
               {"action": "free_completed", "addr": 0x1000, "size": 3 * MiB, "stream": 0},
               {"action": "alloc", "addr": 0x2000000, "size": 12 * MiB, "stream": 0}]
    path = tmp_path / "x.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [entries], "segments": []}, protocol=4))
    return path


def events(path, **options):
    return [tuple(int(v) for v in e) for e in open_trace(path, **options).events()]


def test_convert_to_csv_writes_an_rmm_log(capsys, snapshot, tmp_path):
    dst = tmp_path / "out.csv"
    code, _, err = run(capsys, "convert", snapshot, dst)
    assert code == 0
    text = dst.read_text()
    assert text.startswith("Thread,Time,Action,Pointer,Size,Stream\n0,0,allocate,0x1000,3145728,0x0\n")
    assert open_trace(dst).format == "rmm_csv"
    assert events(dst) == events(snapshot)


def test_convert_to_vmtrace_still_works(capsys, snapshot, tmp_path):
    dst = tmp_path / "out.vmtrace"
    assert run(capsys, "convert", snapshot, dst)[0] == 0
    assert dst.read_bytes()[:8] == b"VMTRACE\0"
    assert events(dst) == events(snapshot)


@pytest.mark.parametrize("name", ["out.json", "out.pickle", "out"])
def test_convert_refuses_a_format_it_does_not_write(capsys, snapshot, tmp_path, name):
    dst = tmp_path / name
    code, _, err = run(capsys, "convert", snapshot, dst)
    assert code == 2 and err.count("\n") == 1
    assert "convert writes .vmtrace" in err and ".csv" in err
    assert not dst.exists() and not Path(str(dst) + ".partial").exists()


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"),
                                          (".pdf", b"%PDF")])
def test_plot_honours_its_suffix(capsys, snapshot, tmp_path, suffix, magic):
    out = tmp_path / ("plot" + suffix)
    code, _, _ = run(capsys, "replay", snapshot, "--no-min-capacity", "-a", "virtual",
                     "--plot", out)
    assert code == 0
    assert out.read_bytes().startswith(magic)


def test_plot_refuses_an_unknown_suffix_before_replaying(capsys, snapshot, tmp_path):
    out = tmp_path / "plot.jpg"
    code, _, err = run(capsys, "replay", snapshot, "--plot", out)
    assert code == 2 and err.count("\n") == 1
    assert "--plot" in err and "*.png" in err and "*.svg" in err
    assert not out.exists()


@pytest.mark.parametrize("command", ["replay", "stress"])
def test_help_names_every_allocator(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "caching and virtual" not in text
    for kind in ALLOCATOR_KINDS:
        assert kind in text
    assert "default: all of " + ", ".join(ALLOCATOR_KINDS) in text


def test_docs_do_not_say_two_allocators():
    text = " ".join((DOCS / "cli.rst").read_text().split())
    assert "caching and virtual" not in text


def test_a_run_stopped_at_event_0_has_no_utilization(tmp_path):
    batch = np.zeros(2, dtype=EVENT_DTYPE)
    batch[0] = (ALLOC, 0, 0x1000, 8 * MiB)
    batch[1] = (FREE, 0, 0x1000, 8 * MiB)
    results = replay(batch, capacity=4 * MiB, min_capacity=False)
    for r in results:
        assert not r.completed and r.out_of_memory_event == 0
        assert r.peak_reserved_bytes == 0 and r.utilization is None
    table = format_table(results)
    line = next(l for l in table.splitlines() if l.strip().startswith("utilization"))
    assert line.split()[1:] == ["-"] * len(results)
    assert "1.000" not in table


class _SlowTrace:
    """A trace whose reading takes 0.3 s (as parsing a large file does)."""

    name = "slow"

    def batches(self):
        time.sleep(0.3)
        batch = np.zeros(2, dtype=EVENT_DTYPE)
        batch[0] = (ALLOC, 0, 0x1000, MiB)
        batch[1] = (FREE, 0, 0x1000, MiB)
        yield batch


def test_reading_is_not_charged_to_the_first_allocator():
    results = replay(_SlowTrace(), min_capacity=False)
    assert [r.allocator for r in results] == list(ALLOCATOR_KINDS)
    for r in results:
        assert r.read_seconds >= 0.3       # the trace's, reported with every allocator
        assert r.replay_seconds < 0.2      # the first allocator's too
    json.dumps([r.to_dict() for r in results])
