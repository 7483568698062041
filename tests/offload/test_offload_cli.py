"""``vmalloc offload``: JSON keys, tables and one-line errors with exit status 2."""

import json

import pytest

from vmalloc.cli import main

KEYS = {"images_per_second", "in_core_images_per_second", "relative_speed",
        "iteration_seconds", "peak_requested_bytes", "peak_reserved_bytes",
        "swapped_out_bytes", "swapped_in_bytes", "out_of_memory"}


def run(capsys, *argv):
    code = main(["offload", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json(capsys):
    code, out, err = run(capsys, "simulate", "--model", "resnet50", "--batch", "512",
                         "--scheduler", "window", "--allocator", "virtual", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert KEYS <= set(d)
    assert d["out_of_memory"] is False and d["images_per_second"] > 0
    assert d["batch"] == 512 and d["planned"]["feasible"]


def test_simulate_fixed_budget_out_of_memory(capsys, tmp_path):
    # past the in-core limit of the default profile (pytorch-eager, amp: 378 at half the
    # activation bytes; nnabla's float32 activations stop at 193)
    code, out, err = run(capsys, "simulate", "--batch", "512", "--scheduler", "none",
                         "--allocator", "caching", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["out_of_memory"] is True and d["oom_function"]["name"]
    png = tmp_path / "t.png"
    code, out, err = run(capsys, "simulate", "--batch", "64", "--budget", "12GiB",
                         "--window", "1GiB", "--plot", str(png))
    assert code == 0, err
    assert "images/s" in out and png.stat().st_size > 1000


def test_saved_sequence_file(capsys, tmp_path):
    from vmalloc.offload.sequence.models import model_sequence

    path = tmp_path / "r.json.gz"
    model_sequence("resnet50", 32).save(path)
    code, out, err = run(capsys, "simulate", "--model", str(path), "--scheduler", "vdnn",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["batch"] == 32


def test_table_json(capsys):
    code, out, err = run(capsys, "table", "--batches", "64,1440", "--json")
    assert code == 0, err
    t = json.loads(out)
    assert t["in_core_limit"] > 64
    rows = {r["batch"]: r for r in t["rows"]}
    assert rows[64]["paper_in_core"] == 336
    assert rows[1440]["in_core"] is None and rows[1440]["window+virtual"] > 0


def test_table_choices_columns(capsys):
    """--choices adds recompute and recompute+fp16 columns: the planner keeps the fastest of
    its variants (no recompute among them), so the recompute column is never slower. TF32:
    float32 activations, so fp16 compression applies (under amp, the A100's default, it
    would not)."""
    code, out, err = run(capsys, "table", "--model", "unet", "--gpu", "a100-40gb",
                         "--batches", "56", "--choices", "--json", "--precision", "tf32")
    assert code == 0, err
    row = {r["batch"]: r for r in json.loads(out)["rows"]}[56]
    assert row["in_core"] is None
    assert row["window+virtual+recompute"] >= row["window+virtual"] > 0
    assert row["window+virtual+recompute+fp16"] > 0
    assert row["window+virtual+recompute:relative"] > 0
    code, out, err = run(capsys, "table", "--model", "unet", "--gpu", "a100-40gb",
                         "--batches", "56", "--choices", "--precision", "tf32")
    assert "win+rc" in out and "rc+fp16" in out and "lossy, opt-in" in out


def test_lists(capsys):
    assert run(capsys, "gpus")[1].count("\n") >= 3
    assert "resnet50" in run(capsys, "models")[1]


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--gpu", "tpu"], "unknown GPU"),
    (["simulate", "--model", "nope"], "--model nope: not a shipped model"),
    (["simulate", "--scheduler", "lms", "--budget", "1GiB"], "--scheduler window"),
    (["simulate", "--batch", "0"], "--batch"),
    (["simulate", "--budget", "lots"], "error"),
    (["simulate", "--scheduler", "magic"], "invalid choice"),
    (["table", "--batches", "a,b"], "--batches"),
    ([], "error"),
])
def test_errors_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and not out


# --- the command line in its own terms (issue 17, item 2) -------------------------------------

def _sequence_file(tmp_path, **changes):
    obj = {"format": "vmalloc-function-sequence", "version": 1, "name": "tiny", "batch": 4,
           "variables": [[1 << 20, 0, 0, "x"], [1 << 20, 0, 0, "y"]],
           "functions": [["f", [0], [1], 1e9, 1e9, None]]}
    obj.update(changes)
    path = tmp_path / "seq.json"
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.mark.parametrize("argv, error", [
    (["simulate", "--budget", "40GiB"], "vmalloc offload simulate: error: --budget 40.00 GiB "
     "is above the memory of the v100-16gb (16.00 GiB)"),
    (["simulate", "--gpu", "a100-40gb", "--window", "41GiB"], "vmalloc offload simulate: "
     "error: --window 41.00 GiB is above the memory of the a100-40gb (40.00 GiB)"),
    (["simulate", "--chunk-size", "3MiB"], "vmalloc offload simulate: error: --chunk-size "
     "3.00 MiB is not a multiple of the device granularity (2.00 MiB): use 2MiB or 4MiB"),
    (["simulate", "--chunk-size", "40MB"], "vmalloc offload simulate: error: --chunk-size "
     "38.15 MiB is not a multiple of the device granularity (2.00 MiB): use 38MiB or 40MiB"),
    (["simulate", "--budget", "0"], "vmalloc offload simulate: error: argument --budget: "
     "'0': must be a positive size such as '2MiB' (see vmalloc offload simulate --help)"),
    (["simulate", "--gpu", "tpu"], "vmalloc offload simulate: error: --gpu tpu: unknown GPU; "
     "choose from v100-16gb, v100-16gb-3brick, p100-16gb, a100-40gb, a100-80gb, h100-80gb"),
    (["simulate", "--model", "{null_batch}"], "vmalloc offload simulate: error: --model "
     "{null_batch}: the sequence records no batch size (\"batch\": null), so images/s and "
     "--batch do not apply; save it with the batch it was recorded at"),
    (["simulate", "--model", "{empty}"], "vmalloc offload simulate: error: --model {empty}: "
     "the sequence has no functions: nothing to simulate"),
    (["table", "--model", "{empty}"], "vmalloc offload table: error: --model {empty}: the "
     "sequence has no functions: nothing to simulate"),
    (["train", "--steps", "1"], "vmalloc offload train: error: --steps must be at least 2 "
     "(one recorded iteration, one scheduled), got 1"),
    (["simulate", "--model", "{not_json}"], "vmalloc offload simulate: error: --model "
     "{not_json}: not JSON: expecting value: line 1 column 1 (char 0)"),
    (["simulate", "--batch", "999999999999"], "vmalloc offload simulate: error: --batch "
     "999999999999: variable input0 would have 602111999999397888 bytes at batch 999999999999"),
])
def test_errors_in_cli_terms_with_one_prefix(capsys, tmp_path, argv, error):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files = {"null_batch": _sequence_file(tmp_path / "a", batch=None),
             "empty": _sequence_file(tmp_path / "b", functions=[], variables=[]),
             "not_json": str(tmp_path / "x.json")}
    (tmp_path / "x.json").write_text("no")
    argv = [a.format(**files) for a in argv]
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", error.format(**files) + "\n")


def test_sizes_are_human_readable_in_text_and_bytes_in_json(capsys):
    argv = ["simulate", "--batch", "64", "--budget", "8GiB", "--window", "256MiB"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "parameters: window=256.00 MiB, budget=8.00 GiB, drop=True\n" in out
    code, out, err = run(capsys, *argv, "--json")
    assert json.loads(out)["planned"]["params"] == {"window": 256 << 20, "budget": 8 << 30,
                                                  "drop": True}
    assert "16.00 GiB" in run(capsys, "gpus")[1].splitlines()[0]


def test_a_function_of_1e308_seconds_is_one_line(capsys, tmp_path):
    # Was an OverflowError traceback (intermediate overflow in fsum) from the simulator.
    path = _sequence_file(tmp_path, functions=[["f", [0], [1], 1e9, 1e9, 1e308],
                                               ["g", [1], [0], 1e9, 1e9, 1e308]])
    code, out, err = run(capsys, "simulate", "--model", path)
    assert (code, out, err) == (2, "", f"vmalloc offload simulate: error: --model {path}: "
                                "functions[0]: seconds 1e+308 is above the most a function "
                                "may give (1e+06)\n")


def test_train_refuses_a_fraction_that_leaves_no_device(capsys):
    # Was a run with no memory limit ("budget_bytes": null, "identical": true) that then
    # crashed in binary_unit (a device of 0 bytes is an unlimited HostDevice).
    code, out, err = run(capsys, "train", "--steps", "2", "--fraction", "0.01")
    assert (code, out) == (2, "")
    assert err == ("vmalloc offload train: error: --fraction 0.01 of the in-core peak "
                   "(117,727,232 bytes) leaves a device of 0 bytes (capacities are whole 2 MiB "
                   "units): use at least 0.0179\n")


@pytest.mark.parametrize("steps", ["1001", "100000000000000000000"])
def test_train_refuses_steps_past_the_bound_before_any_work(capsys, monkeypatch, steps):
    # 10**20 steps was an OverflowError traceback (the data of every step is made up front).
    from vmalloc.frameworks import numpy_training

    monkeypatch.setattr(numpy_training, "train", lambda *a, **k: pytest.fail("trained"))
    code, out, err = run(capsys, "train", "--steps", steps)
    assert (code, out, err) == (2, "", "vmalloc offload train: error: --steps must be at most "
                                f"1,000 (each step's data is made up front), got {steps}\n")


def test_compare_refuses_bad_steps_and_fractions():
    from vmalloc.errors import InvalidArgumentError
    from vmalloc.frameworks.numpy_training import compare

    for kwargs, message in ((dict(steps=10 ** 20), "steps must be 2 to 1,000, got 10"),
                            (dict(fraction=0.0), "fraction must be in (0, 1], got 0.0")):
        with pytest.raises(InvalidArgumentError) as info:
            compare(**kwargs)
        assert str(info.value).startswith(message)


def test_simulate_the_paper_workload_on_its_own_calibration(capsys):
    """``--model resnet50-nnabla --profile nnabla`` simulates the paper's graph with the fit
    made on it (0.464 / 179.75 us: the paper's 581 images/s at 190, in core), not the fit made
    on PyTorch's graph (615.8 images/s on this graph before the CLI passed the model)."""
    code, out, err = run(capsys, "simulate", "--model", "resnet50-nnabla", "--gpu", "v100-16gb",
                         "--profile", "nnabla", "--batch", "190", "--scheduler", "none",
                         "--allocator", "caching", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["out_of_memory"] is False
    assert d["images_per_second"] == pytest.approx(580.72, abs=0.01)
