"""``vmalloc doctor``: without a GPU (the driver library missing: one line says so, the checks
run on the driver emulator), the GPU branch with the emulator standing in for libcuda, a
broken driver (an injected failure) and the JSON report."""

import json

import pytest

from vmalloc import cli, testing
from vmalloc.cli import doctor, probe

REPORT_KEYS = {"vmalloc", "python", "gpu", "ran_on", "no_gpu_reason", "device", "round_trip_us",
               "bandwidth", "host_memory", "frameworks", "problems", "seconds", "exit_code"}


@pytest.fixture
def no_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("VMALLOC_LIBCUDA", str(tmp_path / "no-such" / "libcuda.so.1"))


@pytest.fixture
def emulated_driver(monkeypatch):
    # The emulator stands in for libcuda: the doctor's GPU branch runs on it.
    monkeypatch.setenv("VMALLOC_LIBCUDA", testing.emulated_driver_path())


def test_without_a_gpu_says_so_in_one_line_and_checks_the_emulator(no_driver, capsys):
    assert cli.main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("no GPU: no CUDA driver (libcuda.so.1) found; the checks below ran on "
                        "driver emulator (vmalloc.testing)")
    assert sum(line.startswith("no GPU") for line in lines) == 1
    assert lines[1].startswith("device: vmalloc emulated GPU ")
    assert lines[2].startswith("virtual memory management: yes")
    assert "granularity 2.00 MiB minimum, 2.00 MiB recommended" in lines[2]
    assert lines[3].startswith("round trip: AddressReserve ")
    assert lines[4].startswith("pinned copies (64.00 MiB): host to device ")
    assert lines[5].startswith("host memory for swapping: ")
    assert [line.split()[0] for line in lines[6:9]] == ["torch", "cupy", "cuda_core"]
    assert lines[-1] == "status: ok"
    assert not any(line.startswith("PROBLEM") for line in lines)


def test_json_report_without_a_gpu(no_driver, capsys):
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == REPORT_KEYS
    assert (report["gpu"], report["ran_on"], report["no_gpu_reason"], report["exit_code"]) == (
        False, "driver emulator (vmalloc.testing)", "no CUDA driver (libcuda.so.1) found", 0)
    assert list(report["round_trip_us"]) == list(probe.CALLS)
    assert all(v > 0 for v in report["round_trip_us"].values())
    assert report["device"]["granularity_minimum_bytes"] == 2 << 20
    assert report["bandwidth"]["bytes"] == doctor.BANDWIDTH_BYTES
    assert set(report["frameworks"]) == {"torch", "cupy", "cuda_core"}
    # No GPU: nothing can allocate GPU memory from vmalloc now.
    assert not any(fw["usable"] for fw in report["frameworks"].values())
    assert set(report["host_memory"]) == {
        "available_bytes", "total_bytes", "cgroup_limit_bytes", "cgroup_usage_bytes",
        "memlock_limit_bytes", "swap_room_bytes"}


def test_gpu_branch_on_the_emulator_standing_in_for_libcuda(emulated_driver, capsys):
    report = doctor.run()
    assert report["gpu"] is True and report["no_gpu_reason"] is None
    assert report["ran_on"] == f"vmalloc emulated GPU 0 via {testing.emulated_driver_path()}"
    assert report["device"]["library_path"] == testing.emulated_driver_path()
    assert report["exit_code"] == 0
    lines = doctor.format_report(report)
    assert not any(line.startswith("no GPU") for line in lines)
    assert lines[0].startswith("device: vmalloc emulated GPU 0, 16.00 GiB, driver 12.4 (")
    cupy = report["frameworks"]["cupy"]
    assert cupy["usable"] is (cupy["version"] is not None)


def test_a_failing_driver_is_one_problem_line_with_its_fix_and_exit_1(emulated_driver, capsys):
    emu = testing.emulator()
    with emu.fault("cuMemCreate", nth=1, count=0):
        code = cli.main(["doctor"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    problems = [line for line in lines if line.startswith("PROBLEM: ")]
    assert problems[0].startswith("PROBLEM: a virtual memory round trip failed: ")
    assert "; fix: update the NVIDIA driver" in problems[0]
    assert lines[-1] == "status: broken (see PROBLEM lines)"
    state = emu.device_state(0)
    assert (state["handles"], state["reservations"], state["mappings"]) == (0, 0, 0)


def test_no_gpu_reasons():
    class E(Exception):
        def __init__(self, call, code_name):
            self.call, self.code_name = call, code_name

    assert doctor._no_gpu_reason(E("dlopen", None)) == ("no CUDA driver (libcuda.so.1) found",
                                                        False)
    assert doctor._no_gpu_reason(E("cuInit", "CUDA_ERROR_NO_DEVICE")) == (
        "the CUDA driver sees no GPU", False)
    reason, broken = doctor._no_gpu_reason(E("cuInit", "CUDA_ERROR_UNKNOWN"))
    assert broken and reason.startswith("the CUDA driver failed: ")


def test_listed_in_the_help(capsys):
    assert cli.main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out


def test_usage_error_is_one_line(capsys):
    assert cli.main(["doctor", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err == ("vmalloc doctor: error: unrecognized arguments: --bogus "
                   "(see vmalloc doctor --help)\n")
