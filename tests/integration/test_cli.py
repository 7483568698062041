"""The ``vmalloc`` command line (vmalloc.cli): replay, stress, bench, convert, errors."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import vmalloc
from vmalloc.cli import main
from vmalloc.traces import VmtraceWriter, builtin_traces
from vmalloc.traces.events import ALLOC, EVENT_DTYPE, FREE

MiB = 1 << 20
SNAPSHOT = (Path(__file__).resolve().parents[3] / "shared" / "traces"
            / "torch_snapshot_transformer_lm.pickle")
REQUIRED_KEYS = {"trace", "allocator", "events", "peak_requested_bytes",
                 "peak_reserved_bytes", "utilization", "min_capacity_bytes", "driver_calls",
                 "memory_management_calls", "modeled_driver_seconds", "out_of_memory_event",
                 "peak_internal_fragmentation_bytes", "peak_live_allocations"}


@pytest.fixture
def small_trace(tmp_path):
    """A 6-event .vmtrace: 3 MiB, 700 B and 12 MiB allocations, all freed."""
    trace = np.zeros(6, dtype=EVENT_DTYPE)
    rows = [(ALLOC, 0x1000, 3 * MiB), (ALLOC, 0x2000, 700), (FREE, 0x1000, 3 * MiB),
            (ALLOC, 0x3000, 12 * MiB), (FREE, 0x2000, 700), (FREE, 0x3000, 12 * MiB)]
    for i, (op, addr, size) in enumerate(rows):
        trace[i] = (op, 0, addr, size)
    path = tmp_path / "small.vmtrace"
    with VmtraceWriter(path, consistent=True) as writer:
        writer.write(trace)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_json_reports_each_allocator(capsys, small_trace):
    code, out, err = run(capsys, "replay", str(small_trace), "--json")
    assert code == 0
    results = json.loads(out)
    assert [r["allocator"] for r in results] == ["caching", "expandable-segments", "virtual",
                                                "virtual-packed"]
    for r in results:
        assert REQUIRED_KEYS <= set(r)
        assert r["trace"] == "small"
        assert r["events"] == 6
        assert r["peak_requested_bytes"] == 12 * MiB + 700
        assert r["utilization"] == r["peak_requested_bytes"] / r["peak_reserved_bytes"]
        assert r["min_capacity_exact"] is True
    assert results[1]["min_capacity_bytes"] == 22 * MiB  # a 20 MiB and a 2 MiB page
    assert results[2]["min_capacity_bytes"] == 14 * MiB
    assert err == ""  # no progress bar when stderr is not a terminal, nor in --json


def test_replay_options_and_the_table(capsys, small_trace):
    code, out, _ = run(capsys, "replay", str(small_trace), "-a", "virtual",
                       "--capacity", "12MiB", "--chunk-size", "4MiB", "--no-min-capacity")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "small (capacity 12.00 MiB)"
    assert lines[1].split() == ["virtual"]
    assert "event 3 (12.00 MiB)" in out  # 12 MiB + the 3 MiB still cached do not fit
    assert "caching" not in out.split("\n\nverdict")[0]  # the table: virtual only


def test_replay_allocators_by_comma_and_repeat(capsys, small_trace):
    for argv in (["-a", "virtual,caching"], ["-a", "virtual", "-a", "caching"]):
        code, out, _ = run(capsys, "replay", str(small_trace), "--json", "--no-min-capacity",
                           *argv)
        assert code == 0
        assert [r["allocator"] for r in json.loads(out)] == ["virtual", "caching"]
        assert all(r["min_capacity_bytes"] is None for r in json.loads(out))


def test_replay_plot_writes_a_png(capsys, small_trace, tmp_path):
    png = tmp_path / "out.png"
    code, _, err = run(capsys, "replay", str(small_trace), "--plot", str(png),
                       "--no-min-capacity")
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert f"plot written to {png}" in err


def test_stress_reports_the_patterns(capsys):
    code, out, _ = run(capsys, "stress", "growing", "swap", "--json", "--no-min-capacity",
                       "--seed", "2", "-a", "caching,virtual")
    assert code == 0
    results = json.loads(out)
    assert [(r["trace"], r["allocator"]) for r in results] == [
        ("growing", "caching"), ("growing", "virtual"), ("swap", "caching"),
        ("swap", "virtual")]
    from vmalloc.replay.stress import generate, trace_peaks

    expected = trace_peaks(generate("swap", seed=2))["peak_requested_bytes"]
    assert results[2]["peak_requested_bytes"] == results[3]["peak_requested_bytes"] == expected


@pytest.mark.parametrize("argv, message", [
    (["replay", "--capacity", "12XB"], "capacity"),
    (["replay", "/nonexistent/trace.pickle"], "/nonexistent/trace.pickle"),
    (["replay", "{trace}", "--capacity", "0"], "argument --capacity: '0': must be a positive size"),
    (["replay", "{trace}", "--format", "nope"], "unknown trace format 'nope'"),
    (["replay", "{garbage}"], "trace format"),
    (["replay", "{trace}", "--max-probes", "0"], "--max-probes"),
    (["stress", "nope"], "unknown stress pattern 'nope'"),
    (["replay", "-a", "buddy"], "unknown allocator 'buddy'"),
    (["frobnicate"], "invalid choice"),
])
def test_errors_are_one_line_and_exit_2(capsys, tmp_path, small_trace, argv, message):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01 this is no trace")
    argv = [a.format(trace=small_trace, garbage=garbage) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"vmalloc {argv[0]}: error: " if argv[0] != "frobnicate"
                          else "vmalloc: error: ")


def test_bench_dispatches_or_says_it_is_absent(capsys):
    if importlib.util.find_spec("vmalloc.bench") is not None:
        # Everything after "bench" is the benchmark's own command line.
        code, out, _ = run(capsys, "bench", "--help")
        assert code == 0
        assert out.startswith("usage: vmalloc bench")
        return
    code, _, err = run(capsys, "bench", "--anything")
    assert code == 2
    assert "vmalloc.bench" in err and "not part of this installation" in err


def test_convert_writes_a_vmtrace(capsys, small_trace, tmp_path):
    dst = tmp_path / "copy.vmtrace"
    code, _, _ = run(capsys, "convert", str(small_trace), str(dst))
    assert code == 0
    code, out, _ = run(capsys, "replay", str(dst), "--json", "--no-min-capacity")
    assert code == 0
    assert json.loads(out)[0]["peak_requested_bytes"] == 12 * MiB + 700


def test_replay_without_a_trace_uses_the_builtin_one(capsys):
    code, out, err = run(capsys, "replay", "-a", "virtual", "--no-min-capacity", "--json")
    if not builtin_traces():
        assert code == 2 and "no built-in trace" in err
        return
    assert code == 0
    assert {r["trace"] for r in json.loads(out)} == set(builtin_traces())


@pytest.mark.skipif(not SNAPSHOT.exists(), reason="shared PyTorch snapshot not present")
def test_replay_a_pytorch_snapshot(capsys):
    code, out, _ = run(capsys, "replay", str(SNAPSHOT), "--json", "--no-min-capacity")
    assert code == 0
    results = json.loads(out)
    assert results[0]["trace"] == "torch_snapshot_transformer_lm"
    assert all(r["peak_requested_bytes"] == 1_999_716_608 for r in results)


def test_python_dash_m_and_help(tmp_path):
    env = dict(os.environ)
    # The directory holding the vmalloc under test (not resolved: a development build links
    # its Python files to the source tree, which has no compiled modules).
    package_root = str(Path(vmalloc.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "vmalloc", "replay", "--help"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0
    for option in ("--capacity", "--chunk-size", "--max-split-size", "--json", "--plot",
                   "--no-min-capacity", "--allocator", "--format", "--device"):
        assert option in done.stdout
    assert main(["--version"]) == 0


def test_replay_steal_before_create_reaches_the_virtual_allocators(capsys, small_trace):
    # The 3 MiB tensor's 2 chunks are cached when the 12 MiB one (6 chunks) comes: stealing
    # first remaps them (peak 6 + the small-block arena's chunk), creating first does not.
    peaks = {}
    for flag in ("--steal-before-create", "--no-steal-before-create"):
        code, out, _ = run(capsys, "replay", str(small_trace), "--json", "--no-min-capacity",
                           "-a", "virtual,caching", flag)
        assert code == 0
        virtual, caching = json.loads(out)
        assert virtual["options"] == {"steal_before_create": flag == "--steal-before-create"}
        assert caching["options"] == {}  # not a caching allocator option
        peaks[flag] = virtual["peak_reserved_bytes"]
    assert peaks == {"--steal-before-create": 14 * MiB, "--no-steal-before-create": 18 * MiB}


def test_replay_remap_slack_reaches_packed_placement_only(capsys, small_trace):
    code, out, _ = run(capsys, "replay", str(small_trace), "--json", "--no-min-capacity",
                       "-a", "virtual-packed,virtual", "--remap-slack", "0.0625")
    assert code == 0
    packed, chunks = json.loads(out)
    assert packed["options"] == {"remap_slack": 0.0625}
    assert chunks["options"] == {}
    code, out, err = run(capsys, "replay", str(small_trace), "-a", "virtual-packed",
                         "--remap-slack", "2")
    assert code == 2 and out == ""
    assert "--remap-slack must be in [0, 1], got 2" in err


# --- the command line in its own terms (issue 17, item 2) -------------------------------------

def _options_without_help(parser, path=("vmalloc",)):
    """(command, option) for every argument of every (sub)command that has no help text."""
    import argparse

    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _options_without_help(sub, path + (name,))
        elif not isinstance(action, (argparse._HelpAction,)) and not action.help:
            missing.append((" ".join(path), "/".join(action.option_strings) or action.dest))
    return missing


def test_every_option_of_every_command_has_help():
    from vmalloc.cli import _parser

    assert _options_without_help(_parser()) == []


@pytest.mark.parametrize("argv, error", [
    # library words become flags: no "format=", no "(None for unlimited)", no class names
    (["replay", "{garbage}"], "vmalloc replay: error: {garbage}: cannot tell the trace format "
     "from the content or the name; pass --format, one of torch_snapshot, kineto, rmm_csv, "
     "vmtrace"),
    (["replay", "{trace}", "--chunk-size", "3MiB"], "vmalloc replay: error: --chunk-size "
     "3.00 MiB is not a multiple of the device granularity (2.00 MiB): use 2MiB or 4MiB"),
    (["stress", "swap", "--chunk-size", "3MiB"], "vmalloc stress: error: --chunk-size "
     "3.00 MiB is not a multiple of the device granularity (2.00 MiB): use 2MiB or 4MiB"),
    (["replay", "{trace}", "--granularity", "1MiB", "--chunk-size", "2.5MiB"],
     "vmalloc replay: error: --chunk-size 2.50 MiB is not a multiple of the device "
     "granularity (1.00 MiB): use 2MiB or 3MiB"),
    (["stress", "swap", "-a", "virtual-packed", "--remap-slack", "2"],
     "vmalloc stress: error: --remap-slack must be in [0, 1], got 2.000000"),
    (["stress", "swap", "-a", "caching", "--max-split-size", "1MiB"],
     "vmalloc stress: error: --max-split-size 1.00 MiB (1048576 bytes) is below 20 MiB (kLargeBuffer), "
     "PyTorch's minimum"),
    (["stress", "swap", "--scale", "0"], "vmalloc stress: error: --scale must be a positive "
     "int, got 0"),
])
def test_errors_name_the_flags(capsys, tmp_path, small_trace, argv, error):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01 this is no trace")
    argv = [a.format(trace=small_trace, garbage=garbage) for a in argv]
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", error.format(garbage=garbage) + "\n")


def test_a_chunk_size_the_allocator_takes_is_taken_by_every_command(capsys, small_trace):
    code, out, err = run(capsys, "replay", str(small_trace), "-a", "virtual", "--chunk-size",
                         "4MiB", "--json", "--no-min-capacity")
    assert code == 0, err
    assert json.loads(out)[0]["options"]["chunk_size"] == 4 * MiB
    code, out, err = run(capsys, "offload", "simulate", "--batch", "32", "--chunk-size",
                         "4MiB", "--json")
    assert code == 0, err
    assert json.loads(out)["chunk_size"] == 4 * MiB


def _result(allocator, reserved, min_capacity, completed=True, oom=None):
    from vmalloc.replay import ReplayResult

    return ReplayResult(
        trace="t", allocator=allocator, events=10, trace_events=10, completed=completed,
        capacity_bytes=None, granularity_bytes=2 * MiB, peak_requested_bytes=100 * MiB,
        peak_reserved_bytes=reserved, peak_allocated_bytes=100 * MiB,
        utilization=100 * MiB / reserved, peak_internal_fragmentation_bytes=0,
        peak_live_allocations=1, allocations=5, frees=5, unknown_frees=0,
        reused_addresses=0, streams=1, out_of_memory_event=oom,
        out_of_memory_request_bytes=None, driver_calls=0, memory_management_calls=0,
        modeled_driver_seconds=0.0, driver_call_counts={}, replay_seconds=0.0,
        engine_seconds=0.0, events_per_second=0.0, min_capacity_bytes=min_capacity,
        min_capacity_exact=None if min_capacity is None else True)


def test_verdict_says_yes_a_little_or_no_with_the_savings_and_the_smallest_device():
    from vmalloc.replay.verdict import verdict

    yes = verdict([_result("caching", 200 * MiB, 180 * MiB),
                   _result("virtual", 110 * MiB, 104 * MiB),
                   _result("virtual-packed", 102 * MiB, 102 * MiB)])
    assert yes == (
        "verdict: yes, virtual addressing fixes this trace's fragmentation: virtual-packed "
        "needs 78.00 MiB less than caching (102.00 MiB against 180.00 MiB min capacity, 43 %) "
        "and reserves 98.00 MiB less at peak; the smallest device that runs it: 102.00 MiB "
        "(virtual-packed; caching: 180.00 MiB)")
    little = verdict([_result("caching", 110 * MiB, 104 * MiB),
                      _result("virtual", 112 * MiB, 102 * MiB)])
    assert little.startswith("verdict: a little: virtual needs 2.00 MiB less than caching "
                             "(102.00 MiB against 104.00 MiB min capacity, 2 %), though it "
                             "reserves 2.00 MiB more at peak")
    assert little.endswith("the smallest device that runs it: 102.00 MiB (virtual; caching: "
                           "104.00 MiB)")
    no = verdict([_result("caching", 100 * MiB, 100 * MiB),
                  _result("virtual", 104 * MiB, 104 * MiB)])
    assert no.startswith("verdict: no, caching already runs this trace in as little memory")
    oom = verdict([_result("caching", 90 * MiB, None, completed=False, oom=7),
                   _result("virtual", 100 * MiB, 100 * MiB)])
    assert oom.startswith("verdict: yes, virtual addressing fixes this trace: caching runs "
                          "out of memory at event 7 where virtual runs it whole")


def test_replay_ends_with_a_verdict_line_matching_its_table(capsys, small_trace):
    code, out, err = run(capsys, "replay", str(small_trace), "--json")
    results = {r["allocator"]: r for r in json.loads(out)}
    code, out, err = run(capsys, "replay", str(small_trace))
    assert code == 0, err
    last = out.rstrip("\n").splitlines()[-1]
    assert last.startswith("verdict: ")
    best = min((r for k, r in results.items() if k.startswith("virtual")),
               key=lambda r: r["min_capacity_bytes"])
    assert (f"the smallest device that runs it: "
            f"{vmalloc.format_size(best['min_capacity_bytes'])} ({best['allocator']}; "
            f"caching: {vmalloc.format_size(results['caching']['min_capacity_bytes'])})") in last
    # JSON keeps its list of results (bytes), no verdict text
    code, out, err = run(capsys, "replay", str(small_trace), "--json")
    assert "verdict" not in out


def test_several_traces_get_one_verdict_each(capsys):
    code, out, err = run(capsys, "stress", "swap", "growing", "-a", "caching,virtual")
    assert code == 0, err
    tail = out.rstrip("\n").splitlines()[-2:]
    assert tail[0].startswith("swap: verdict: ") and tail[1].startswith("growing: verdict: ")
