"""scripts/gpu-check: the dry run writes a complete report (every section, exact keys, what it
ran on, the PNG), and the runner's promises: a failing step is recorded and the next one runs,
the budget skips what no longer fits (saying so), report.json is written after every step.
Also the real-GPU ``cuda`` device kind of tests/conftest.py (absent without a GPU)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpucheck import png, run, schema, tests_step  # noqa: E402

MiB = 1 << 20


def _env():
    env = dict(os.environ)
    # The child processes import vmalloc as this process does (installed, or a dev build).
    import vmalloc

    # Not resolved: a dev build's files are links into the source tree.
    here = os.path.dirname(os.path.dirname(os.path.abspath(vmalloc.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                  else []))
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check"), "--dry-run",
                           "--quick", "--out", str(out)], env=_env(), cwd=out,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text()), proc.stdout


# The dry run takes about a minute on a busy 2-core machine (the fixture's time counts here).
@pytest.mark.timeout(600)
def test_dry_run_report_is_complete(dry_run):
    out, report, stdout = dry_run
    assert (report["dry_run"], report["quick"], report["finished"] is not None) == (True, True,
                                                                                  True)
    assert list(report["sections"]) == list(schema.SECTIONS)
    without_torch = importlib.util.find_spec("torch") is None
    for name, section in report["sections"].items():
        assert tuple(section) == schema.SECTION_KEYS, name
        if without_torch and name in ("torch_out_of_core", "simulator_vs_measured",
                                      "timeline"):
            assert section["status"] == "skipped" and section["reason"], name
            continue
        assert section["status"] == "ok", (name, section["error"], section["reason"])
        assert isinstance(section["ran_on"], str) and section["ran_on"], name
        assert tuple(section["result"]) == schema.RESULT_KEYS[name], name
        assert section["seconds"] <= section["limit_seconds"], name
    s = report["sections"]
    for name in ("device", "driver_costs", "bandwidth"):
        assert s[name]["ran_on"].startswith("driver emulator (vmalloc emulated GPU "), name
    assert s["tests"]["ran_on"] == "driver emulator (cuda-emulator kind, --dry-run)"
    # stdout ends with the table: one line per section, then the report's path.
    assert stdout.splitlines()[-1] == f"report: {out / 'report.json'}"
    assert [line.split()[0] for line in stdout.splitlines()[-1 - len(schema.SECTIONS):-1]] \
        == list(schema.SECTIONS)
    if not without_torch:
        assert s["torch_out_of_core"]["ran_on"].endswith("on CPU, poison backend (--dry-run)")
        assert s["simulator_vs_measured"]["ran_on"] == "vmalloc.offload simulator (host)"


@pytest.mark.timeout(600)
def test_dry_run_sections_measure(dry_run):
    out, report, _ = dry_run
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed: the torch sections are skipped (checked above)")
    s = {k: v["result"] for k, v in report["sections"].items()}
    assert s["device"]["granularity_minimum_bytes"] == 2 * MiB
    assert s["device"]["vmm_supported"] is True
    assert s["build"]["method"] == "existing" and s["build"]["reused"] is True
    assert s["tests"]["device_kinds"] == ["cuda-emulator"]
    assert s["tests"]["passed"] > 0 and (s["tests"]["failed"], s["tests"]["errors"]) == (0, 0)
    assert s["driver_costs"]["sizes_bytes"] == [2 * MiB, 20 * MiB, 512 * MiB]
    from vmalloc.cli import probe

    assert list(s["driver_costs"]["calls"]) == list(probe.CALLS)
    assert all(v["median_us"] > 0 for call in s["driver_costs"]["calls"].values()
               for v in call.values())
    assert s["driver_costs"]["reference"]["us"]["cuMemCreate"] == 193.0
    assert all(s["bandwidth"][k] > 0 for k in ("pinned_h2d_gbps", "pinned_d2h_gbps",
                                                "pinned_both_each_direction_gbps",
                                                "pageable_h2d_gbps", "pageable_d2h_gbps"))
    t = s["torch_out_of_core"]
    assert t["backend"] == "poison" and t["in_core"]["limit"] == 8
    assert [r["batch"] for r in t["in_core"]["runs"]] == [8, 4]
    assert [(r["factor"], r["batch"], r["status"]) for r in t["out_of_core"]] == [
        (2, 16, "ok"), (4, 32, "ok")]
    assert t["out_of_core"][1]["swapped_out_bytes"] > 0     # the budget forced swapping
    c = t["correctness"]
    assert (c["status"], c["identical"], c["max_abs_weight_difference"]) == ("ok", True, 0.0)
    g = t["gpt2"]
    if importlib.util.find_spec("transformers") is None:
        assert g["status"].startswith("skipped: transformers is not installed")
    else:
        assert (g["status"], g["batch"], g["tokens"], g["config"]["n_layer"]) == (
            "ok", 2, 64, 2)
        assert g["aten_ops_per_step"] > 0
        for name in ("plain", "out_of_core_no_pressure", "out_of_core_half_memory"):
            assert (g["runs"][name]["status"], g["runs"][name]["losses_identical_to_plain"]) \
                == ("ok", True), name
        half = g["runs"]["out_of_core_half_memory"]
        assert half["budget_bytes"] == g["runs"]["out_of_core_no_pressure"][
            "peak_device_bytes"] // 2
        assert half["peak_device_bytes"] <= half["budget_bytes"] and half["swapped_out_bytes"] > 0
        assert g["runs"]["compiled"]["status"].startswith("skipped: --dry-run")
    assert c["in_core_losses"] == c["out_of_core_losses"]
    sim = s["simulator_vs_measured"]
    assert set(sim["calibrated_on"]) == {"8", "4"}
    assert [r["kind"] for r in sim["runs"]][:2] == ["in_core", "in_core"]
    tl = s["timeline"]
    assert tl["events"]["compute"] > 0
    data = (out / "timeline.png").read_bytes()
    assert tl["png"] == str(out / "timeline.png") and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_writer_round_trip(tmp_path):
    path = tmp_path / "t.png"
    drawn = png.render({"lanes": {"compute": [[0.0, 0.5]], "h2d": [[0.5, 1.0]], "d2h": []},
                        "memory": [[0.0, 10], [0.5, 20]]}, path)
    data = path.read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (drawn["width"], drawn["height"]) == (1200, 370)
    idat = data.index(b"IDAT")
    raw = zlib.decompress(data[idat + 4:idat + 4 + int.from_bytes(data[idat - 4:idat], "big")])
    row = raw[(1 + width * 3) * png.GAP:(1 + width * 3) * (png.GAP + 1)]
    assert row[1:4] == bytes(png.LANES[0][1])                  # compute starts at 0
    assert row[1 + 3 * 700:4 + 3 * 700] == b"\xff\xff\xff"      # and ends at half


def test_pytest_output_parsed_even_when_cut_short():
    out = ("tests/a.py::test_x[cuda] PASSED   [ 10%]\n"
           "tests/a.py::test_y[cuda] FAILED   [ 20%]\n"
           "tests/a.py::test_z[cuda] SKIPPED (why) [ 30%]\n"
           "tests/a.py::test_w[cuda] ERROR\n"
           "tests/a.py::test_v[cuda] PASS")                   # killed mid-line
    counts, failures = tests_step.parse(out)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}
    assert failures == ["tests/a.py::test_y[cuda]", "tests/a.py::test_w[cuda]"]


def test_no_budget_skips_every_step_saying_so(tmp_path, capsys):
    assert run.main(["--dry-run", "--budget", "0", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    for name, section in report["sections"].items():
        assert section["status"] == "skipped", name
        assert section["reason"].startswith("budget: 0 s of 0 s left, too little to start")


def test_a_failing_step_is_recorded_and_written(tmp_path, monkeypatch):
    args = run.parse_args(["--dry-run", "--out", str(tmp_path)])
    report = run.Report(tmp_path, args, {n: 10 for n in schema.SECTIONS})

    def crash(*a, **k):
        raise RuntimeError("the driver said no")

    monkeypatch.setattr(run, "run_child", crash)
    run.run_step("bandwidth", report, args, None, 10, tmp_path)
    on_disk = json.loads((tmp_path / "report.json").read_text())["sections"]["bandwidth"]
    assert (on_disk["status"], on_disk["error"]) == ("failed",
                                                     "RuntimeError: the driver said no")
    monkeypatch.setattr(run, "run_child", lambda *a, **k: (
        "timeout", {"ran_on": "x", "result": {"bytes": 1, "extra": 2}}, "ran past"))
    run.run_step("bandwidth", report, args, None, 10, tmp_path)
    s = json.loads((tmp_path / "report.json").read_text())["sections"]["bandwidth"]
    assert (s["status"], s["ran_on"]) == ("timeout", "x")
    assert tuple(s["result"]) == schema.RESULT_KEYS["bandwidth"] and s["result"]["bytes"] == 1
    assert s["error"] == "ran past (unexpected keys ['extra'])"


def test_a_child_past_its_limit_is_killed_and_recorded(tmp_path):
    args = run.parse_args(["--dry-run", "--out", str(tmp_path)])
    run.Report(tmp_path, args, {n: 10 for n in schema.SECTIONS})
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    (tmp_path / "gpucheck").mkdir()
    (tmp_path / "gpucheck" / "__init__.py").write_text("")
    (tmp_path / "gpucheck" / "section.py").write_text("import time\ntime.sleep(60)\n")
    status, payload, error = run.run_child("device", args, env, 2, tmp_path)
    assert (status, payload) == ("timeout", None)
    assert error.startswith("ran past its 2 s limit")


def _conftest():
    spec = importlib.util.spec_from_file_location("_conftest_gpu", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_gpu_no_cuda_kind(monkeypatch):
    monkeypatch.setenv("VMALLOC_TEST_NO_GPU", "1")
    module = _conftest()
    assert module.REAL_GPU_DRIVER is None
    assert set(module.DEVICE_KINDS) == {"host", "cuda-emulator"}


def test_cuda_kind_opens_the_driver_by_its_path(monkeypatch):
    # The emulator's path stands in for the real driver's.
    from vmalloc import testing

    module = _conftest()
    monkeypatch.setattr(module, "REAL_GPU_DRIVER", testing.emulated_driver_path())
    device = module._cuda_gpu_device(capacity=64 * MiB, granularity="2MiB")
    assert device.library == testing.emulated_driver_path()
    del device
    with pytest.raises(pytest.skip.Exception, match="granularity is 2097152, not 4MiB"):
        module._cuda_gpu_device(granularity="4MiB")


def test_device_kinds_restricted_by_the_environment(monkeypatch):
    monkeypatch.setenv("VMALLOC_TEST_DEVICE_KINDS", "cuda-emulator")
    assert set(_conftest().DEVICE_KINDS) == {"cuda-emulator"}


def test_table_line_per_section_with_figures_or_the_exception():
    data = {"elapsed_seconds": 5.0, "budget_seconds": 480, "dry_run": False, "sections": {
        name: run.empty_section(10) for name in schema.SECTIONS}}
    data["sections"]["bandwidth"].update(status="ok", seconds=2.0, result={
        "pinned_h2d_gbps": 55.31, "pinned_d2h_gbps": 55.1,
        "pinned_both_each_direction_gbps": 52.8, "pageable_h2d_gbps": 27.0})
    data["sections"]["torch_out_of_core"].update(
        status="failed", seconds=3.0,
        error="exit status 1; stderr: Traceback (most recent call last):\n  File x\n"
              "RuntimeError: boom\n")
    lines = run.table(data)
    assert lines[0] == "gpu-check: 5 s of a 480 s budget"
    assert len(lines) == 1 + len(schema.SECTIONS)
    assert lines[1 + schema.SECTIONS.index("bandwidth")].endswith(
        "pinned H2D 55.3, D2H 55.1, both 52.8, pageable H2D 27.0 GB/s")
    assert lines[1 + schema.SECTIONS.index("torch_out_of_core")].endswith(
        "exit status 1; stderr: Traceback (most r ... RuntimeError: boom")
