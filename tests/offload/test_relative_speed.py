"""The paper's relative speed: one figure, the same in ``simulate`` and ``table``, and no in-core
speed quoted for a batch that cannot run in core."""

import json

import pytest

from vmalloc.cli import main
from vmalloc.offload import simulate
from vmalloc.offload.hardware.gpus import GPUS, LE_IN_CORE
from vmalloc.offload.sequence.models import model_sequence
from vmalloc.offload.planning.planner import in_core_reference


def run(capsys, *argv):
    code = main(["offload", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_simulate_and_table_print_the_same_relative_speed(capsys):
    # a small GPU keeps this fast: resnet50 at batch 48 on a 2 GiB V100 is past its limit
    d = json.loads(run(capsys, "simulate", "--batch", "48", "--budget", "1900MiB", "--window",
                       "256MiB", "--json", "--gpu", "v100-16gb", "--profile", "nnabla"))
    limit, ips = in_core_reference("resnet50", "v100-16gb")
    assert d["in_core_limit_batch"] == limit
    assert d["in_core_limit_images_per_second"] == pytest.approx(ips)
    assert d["relative_speed"] == pytest.approx(d["images_per_second"] / ips)
    assert d["speed_vs_compute_only"] == pytest.approx(
        d["compute_seconds"] / d["iteration_seconds"])
    assert d["link"].startswith(GPUS["v100-16gb"].link)
    # batch 48 runs in core on a 16 GiB V100: its in-core speed is quoted
    assert d["in_core_images_per_second"] == pytest.approx(d["compute_only_images_per_second"])


def test_no_in_core_speed_past_the_limit():
    seq = model_sequence("resnet50", 400)
    limit, ips = in_core_reference("resnet50", "v100-16gb")
    assert limit < 400
    r = simulate(seq, None, gpu="v100-16gb", reference=(limit, ips))
    assert r.in_core_images_per_second is None
    assert r.compute_only_images_per_second > 0
    assert "in core at this batch" not in (r.summary() if not r.out_of_memory else "")


def test_p100_calibrated_on_le_et_al_in_core_row():
    for b, published in LE_IN_CORE.items():
        r = simulate(model_sequence("resnet50", b), None, gpu="p100-16gb", allocator="caching")
        assert not r.out_of_memory
        assert r.images_per_second == pytest.approx(published, rel=0.01)
    assert GPUS["p100-16gb"].h2d_bandwidth == 40e9


def test_simulate_plan_flag_prints_the_per_class_plan(capsys):
    out = run(capsys, "simulate", "--batch", "32", "--budget", "1500MiB", "--window", "256MiB",
              "--gpu", "v100-16gb", "--plan", "--recompute")
    assert "keep" in out and "recomp" in out and "native_batch_norm" in out
    assert "predicted step" in out and "bottleneck" in out
    d = json.loads(run(capsys, "simulate", "--batch", "32", "--budget", "1500MiB", "--window",
                       "256MiB", "--plan", "--json"))
    assert d["plan"]["bottleneck"] in ("compute", "H2D", "D2H")
    assert sum(c["variables"] for c in d["plan"]["classes"].values()) > 100
