"""Which device of a trace to replay, and the ranks of one job side by side: a rank's profiler
trace replays with no flags, --device applies to all traces or to one (TRACE=DEVICE), a
directory of ranks makes one table and one plot, and every message speaks in flags."""

import json
from pathlib import Path

import pytest

import vmalloc
from vmalloc.cli import main
from vmalloc.replay import replay
from vmalloc.traces import open_trace, trace_devices

MiB = 1 << 20
CPU_FIXTURE = Path(__file__).resolve().parents[1] / "data" / "profiler_cpu_mlp.json"


def memory_event(addr, nbytes, device_type=1, device_id=0, ts=0):
    return {"ph": "i", "name": "[memory]", "ts": ts, "pid": 1, "tid": 1,
            "args": {"Addr": addr, "Bytes": nbytes, "Device Type": device_type,
                     "Device Id": device_id}}


def rank_trace(path, devices, cpu=False, scale=1):
    """A Kineto trace with memory events for each CUDA ordinal of ``devices``."""
    events = [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1, "args": {}}]
    for d in devices:
        base = 0x7F0000000000 + (d << 36)
        sizes = [3 * MiB * scale, 700, 12 * MiB * scale]
        for i, n in enumerate(sizes):
            events.append(memory_event(base + i * (64 * MiB), n, device_id=d))
        for i, n in enumerate(sizes):
            events.append(memory_event(base + i * (64 * MiB), -n, device_id=d))
    if cpu:
        events.append(memory_event(0x10, 64, device_type=0, device_id=-1))
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_rank1_trace_replays_with_no_flags(capsys, tmp_path):
    path = rank_trace(tmp_path / "rank1.json", [1], cpu=True)
    code, out, err = run(capsys, "replay", path, "--no-min-capacity")
    assert code == 0
    assert out.splitlines()[0] == "rank1 (cuda:1)"
    assert "replaying cuda:1, its only GPU device (it also has cpu" in err
    code, out, _ = run(capsys, "replay", path, "--no-min-capacity", "--json")
    results = json.loads(out)
    assert {r["device"] for r in results} == {"cuda:1"}
    assert all(r["peak_requested_bytes"] == 15 * MiB + 700 for r in results)


def test_api_default_is_the_only_gpu_device(tmp_path):
    path = rank_trace(tmp_path / "rank3.json", [3])
    assert open_trace(path).device == "cuda:3"
    assert trace_devices(path) == {"cuda:3": 6}
    [result] = replay(str(path), ["virtual"], min_capacity=False)
    assert result.device == "cuda:3" and result.events == 6


def test_a_wrong_device_is_explained_with_flags(capsys, tmp_path):
    path = rank_trace(tmp_path / "rank1.json", [1], cpu=True)
    code, _, err = run(capsys, "replay", path, "--device", "0")
    assert code == 2
    assert err.count("\n") == 1
    assert "no memory events for device cuda:0; the trace has events for cpu, cuda:1" in err
    assert "--device rank1.json=1" in err
    assert "device='" not in err and "device=" not in err.replace("--device", "")


def test_cpu_only_trace_says_which_flag(capsys):
    code, _, err = run(capsys, "replay", CPU_FIXTURE)
    assert code == 2 and err.count("\n") == 1
    assert "no GPU memory events, only events for cpu" in err
    assert "--device profiler_cpu_mlp.json=cpu" in err
    assert "device='cpu'" not in err
    code, out, _ = run(capsys, "replay", CPU_FIXTURE, "--device", "cpu", "--json",
                       "--no-min-capacity", "-a", "caching")
    assert code == 0 and json.loads(out)[0]["device"] == "cpu"


def test_several_gpus_in_one_trace_replay_each(capsys, tmp_path):
    path = rank_trace(tmp_path / "node.json", [0, 1])
    code, out, err = run(capsys, "replay", path, "--no-min-capacity", "-a", "virtual")
    assert code == 0
    assert "replaying each of its devices cuda:0, cuda:1" in err
    assert "--device node.json=0" in err
    assert "node [cuda:0] (cuda:0)" in out and "node [cuda:1] (cuda:1)" in out
    assert "side by side" in out
    # The library, asked for its default, names the devices instead of guessing.
    with pytest.raises(vmalloc.TraceFormatError, match=r"several GPU devices \(cuda:0, cuda:1\)"):
        open_trace(path)


def test_device_per_trace_and_for_all(capsys, tmp_path):
    a = rank_trace(tmp_path / "a.json", [0, 1])
    b = rank_trace(tmp_path / "b.json", [1, 2], scale=2)
    # --device 1 applies to every trace.
    code, out, _ = run(capsys, "replay", a, b, "--device", "1", "--json", "--no-min-capacity",
                       "-a", "caching")
    assert code == 0
    assert [(r["trace"], r["device"]) for r in json.loads(out)] == [("a", "cuda:1"),
                                                                   ("b", "cuda:1")]
    # TRACE=DEVICE for one trace, a bare DEVICE for the others, in any order.
    code, out, _ = run(capsys, "replay", a, b, "--device", "b.json=2", "--device", "0",
                       "--json", "--no-min-capacity", "-a", "caching")
    assert code == 0
    results = json.loads(out)
    assert [(r["trace"], r["device"]) for r in results] == [("a", "cuda:0"), ("b", "cuda:2")]
    assert results[1]["peak_requested_bytes"] == 30 * MiB + 700
    # all: every device of every trace.
    code, out, _ = run(capsys, "replay", a, "--device", "all", "--json", "--no-min-capacity",
                       "-a", "caching")
    assert [r["device"] for r in json.loads(out)] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("value,message", [
    ("gpu7", "--device gpu7: expected auto, all"),
    ("nope.json=1", "--device nope.json=1: no TRACE named nope.json"),
])
def test_bad_device_values(capsys, tmp_path, value, message):
    path = rank_trace(tmp_path / "r.json", [0])
    code, _, err = run(capsys, "replay", path, "--device", value)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_a_directory_of_ranks_is_one_table_and_one_plot(capsys, tmp_path):
    ranks = tmp_path / "job"
    ranks.mkdir()
    for r in (0, 1, 2, 10):
        rank_trace(ranks / f"rank{r}.json", [r % 8], scale=r + 1)
    (ranks / "README.txt").write_text("not a trace")
    png = tmp_path / "job.png"
    code, out, err = run(capsys, "replay", ranks, "--no-min-capacity", "-a", "caching,virtual",
                         "--plot", png)
    assert code == 0
    summary = out[out.index("side by side"):].split("\n\n")[0].splitlines()  # verdicts follow
    assert [line.split()[0] for line in summary[2:]] == ["rank0", "rank1", "rank2", "rank10"]
    assert [line.split()[1] for line in summary[2:]] == ["cuda:0", "cuda:1", "cuda:2", "cuda:2"]
    assert "caching reserved (util.)" in summary[1] and "virtual reserved (util.)" in summary[1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run(capsys, "replay", ranks, "--no-min-capacity", "-a", "virtual", "--json")
    assert [r["trace"] for r in json.loads(out)] == ["rank0", "rank1", "rank2", "rank10"]


def test_an_empty_directory_is_an_error(capsys, tmp_path):
    code, _, err = run(capsys, "replay", tmp_path)
    assert code == 2 and "holds no trace file" in err


class _Terminal:
    """A stand-in for stderr on a terminal."""

    def __init__(self):
        self.parts = []

    def isatty(self):
        return True

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass

    def text(self):
        return "".join(self.parts)


def test_progress_on_a_terminal_only(capsys, tmp_path, monkeypatch):
    from vmalloc.traces import _files

    path = rank_trace(tmp_path / "rank1.json", [1])
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["replay", str(path), "-a", "virtual"]) == 0
    drawn = terminal.text()
    assert "\rreading rank1.json [" in drawn          # finding its devices, reading it
    assert "rank1: virtual min capacity" in drawn      # the minimum-capacity search
    assert drawn.count("\r") >= 4
    assert "replaying cuda:1" in drawn
    assert _files.progress_hook is None                # restored
    # --json: no bar, even on a terminal.
    terminal.parts.clear()
    assert main(["replay", str(path), "-a", "virtual", "--json"]) == 0
    assert "\r" not in terminal.text()
    # Not a terminal: nothing (capsys's stderr).
    monkeypatch.undo()
    assert main(["replay", str(path), "-a", "virtual"]) == 0
    assert capsys.readouterr().err.count("\r") == 0
