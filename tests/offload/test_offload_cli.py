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
    code, out, err = run(capsys, "simulate", "--batch", "256", "--scheduler", "none",
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
    from vmalloc.offload.models import model_sequence

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


def test_lists(capsys):
    assert run(capsys, "gpus")[1].count("\n") >= 3
    assert "resnet50" in run(capsys, "models")[1]


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--gpu", "tpu"], "unknown GPU"),
    (["simulate", "--model", "nope"], "unknown model"),
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
