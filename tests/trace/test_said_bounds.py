"""Hostile or degenerate traces get one clear line, fast and in bounded memory (issue 20,
"Also"): a trace with no allocation has a verdict, a trace of thousands of devices is refused
before any per-device work, a snapshot for device 10**9 is refused before it is built, and
an output that cannot be written is named as the user gave it (never its ``.partial``)."""

import json
import os

import pytest

import vmalloc.cli
from vmalloc.cli import main

#: vmalloc.cli.MAX_TRACE_DEVICES (checked below)
MAX_TRACE_DEVICES = 64


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def kineto(path, events):
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "i", "name": "[memory]", "ts": i,
         "args": {"Addr": addr, "Bytes": nbytes, "Device Type": 1, "Device Id": device}}
        for i, (device, addr, nbytes) in enumerate(events)]}))
    return str(path)


def test_a_trace_that_allocates_nothing_has_a_verdict(capsys, tmp_path):
    # Was a ZeroDivisionError traceback at the end of the table (a percentage of 0 B).
    path = kineto(tmp_path / "frees.json", [(0, 4096, -512)])
    code, out, err = run(capsys, "replay", path, "--before-window", "drop")
    assert code == 0 and "Traceback" not in err
    assert out.rstrip().endswith("\nverdict: no, the trace allocates no memory (caching needs "
                                 "0 B): there is nothing to fragment")


@pytest.mark.parametrize("device", [[], ["--device", "all"]], ids=["auto", "all"])
def test_a_trace_of_too_many_devices_is_refused_before_any_replay(capsys, tmp_path,
                                                                  monkeypatch, device):
    # One event on each of 2,000 devices replayed in 90 s: one pass over the file per device.
    import vmalloc.replay

    monkeypatch.setattr(vmalloc.replay, "TraceSource",
                        lambda *a, **k: pytest.fail("a device was replayed"))
    n = MAX_TRACE_DEVICES + 1
    path = kineto(tmp_path / "many.json", [(d, 4096, 512) for d in range(n)])
    code, out, err = run(capsys, "replay", path, *device)
    assert (code, out) == (2, "")
    assert err == (f"vmalloc replay: error: {path}: memory events for {n} devices; vmalloc "
                   f"replay replays at most {MAX_TRACE_DEVICES} devices of one trace (each "
                   "reads the whole file): choose one with --device many.json=0\n")


def test_the_most_devices_still_replay(capsys, tmp_path):
    assert vmalloc.cli.MAX_TRACE_DEVICES == MAX_TRACE_DEVICES
    path = kineto(tmp_path / "many.json", [(d, 4096, 512) for d in range(MAX_TRACE_DEVICES)])
    code, out, err = run(capsys, "replay", path, "--json", "--no-min-capacity",
                         "-a", "caching")
    assert code == 0
    assert len(json.loads(out)) == MAX_TRACE_DEVICES


def test_a_snapshot_for_device_1e9_is_refused_before_it_is_built(capsys, tmp_path,
                                                                  monkeypatch):
    # A 500-byte trace naming device 10**9 ran 98 s and took 2.8 GB (10**9 empty lists).
    from vmalloc.traces import torch_export

    path = kineto(tmp_path / "far.json", [(10 ** 9, 4096, 512)])
    assert os.path.getsize(path) < 500
    monkeypatch.setattr(torch_export, "_segment", lambda *a: pytest.fail("built"))
    code, out, err = run(capsys, "convert", path, str(tmp_path / "far.pickle"),
                         "--to", "torch-snapshot")
    assert (code, out) == (2, "")
    assert err == ("vmalloc convert: error: device cuda:1000000000: a PyTorch snapshot holds "
                   "one list of actions per device up to its own (1,000,000,001 lists); "
                   "refused above cuda:1023\n")
    assert not (tmp_path / "far.pickle").exists()
    snapshot = torch_export.snapshot_from_events([], device=torch_export.MAX_DEVICE)
    assert len(snapshot["device_traces"]) == 1024


@pytest.mark.parametrize("to", [[], ["--to", "torch-snapshot"]], ids=["vmtrace", "snapshot"])
@pytest.mark.parametrize("where, error", [("missing/out", "No such file or directory"),
                                          ("adir", "Is a directory")])
def test_an_unwritable_output_is_named_as_given(capsys, tmp_path, to, where, error):
    # The message named "<dst>.partial", a file the user never chose (and that is gone).
    src = kineto(tmp_path / "one.json", [(0, 4096, 512)])
    dst = str(tmp_path / (where + (".pickle" if to else ".vmtrace")))
    if where == "adir":
        os.mkdir(dst)
    code, out, err = run(capsys, "convert", src, dst, *to)
    assert (code, out, err) == (2, "", f"vmalloc convert: error: {error}: {dst}\n")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def test_the_library_names_the_destination_too(tmp_path):
    from vmalloc.traces import convert
    from vmalloc.traces.torch_export import write_snapshot

    src = kineto(tmp_path / "one.json", [(0, 4096, 512)])
    dst = str(tmp_path / "missing" / "out.vmtrace")
    with pytest.raises(FileNotFoundError) as info:
        convert(src, dst)
    assert info.value.filename == dst and ".partial" not in str(info.value)
    os.mkdir(tmp_path / "adir.pickle")
    with pytest.raises(IsADirectoryError) as info:
        write_snapshot({"segments": [], "device_traces": [[]]}, str(tmp_path / "adir.pickle"))
    assert info.value.filename == str(tmp_path / "adir.pickle")
    assert ".partial" not in str(info.value)


def test_several_devices_are_listed_briefly(capsys, tmp_path):
    # The line listed every device: 2,000 of them made a 20 KB error line.
    path = kineto(tmp_path / "many.json", [(d, 4096, 512) for d in range(2000)])
    code, out, err = run(capsys, "convert", path, str(tmp_path / "out.vmtrace"))
    assert (code, out) == (2, "")
    assert err == (f"vmalloc convert: error: {path}: memory events for several GPU devices "
                   "(cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7, ... (2000 "
                   "in all)): choose one with --device many.json=0, or --device all\n")
