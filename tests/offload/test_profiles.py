"""Compute profiles and precisions (issue 22, item 1): the host timeline of ``pytorch-eager``,
``nnabla``'s serial per-function cost, what each precision stores and runs at, and both named
on every simulation."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from vmalloc.cli import main
from vmalloc.errors import InvalidArgumentError
from vmalloc.offload import FunctionSequence, simulate
from vmalloc.offload.hardware.gpus import GPU
from vmalloc.offload.sequence.models import model_sequence
from vmalloc.offload.simulation.profiles import (CALIBRATIONS, PEAK_FLOPS, apply_precision,
                                      host_chain_seconds, profiled_gpu)
from vmalloc.offload.simulation.simulator import in_core_seconds


def _gpu(**kw):
    base = dict(name="toy", memory_bytes=1 << 30, peak_flops=1e12, compute_efficiency=1.0,
                hbm_bandwidth=1e12, h2d_bandwidth=1e9, d2h_bandwidth=1e9,
                bidirectional_bandwidth=1e9, function_overhead_seconds=0.0)
    base.update(kw)
    return GPU(**base)


def _chain(seconds):
    seq = FunctionSequence("chain", batch=1)
    v = seq.add_variable("1MiB")
    for s in seconds:
        w = seq.add_variable("1MiB")
        seq.add_function([v], [w], seconds=s)
        v = w
    return seq


def test_eager_hides_the_host_cost_behind_longer_kernels():
    # kernels of 1 ms launched 0.1 ms apart: only the first launch shows
    gpu = _gpu(host_seconds=1e-4, profile="pytorch-eager", precision="fp32")
    r = simulate(_chain([1e-3] * 3), gpu=gpu)
    assert r.iteration_seconds == pytest.approx(1e-4 + 3e-3)
    assert r.compute_seconds == pytest.approx(1e-4 + 3e-3)
    assert r.same_batch_compute_ratio == pytest.approx(1.0)
    assert in_core_seconds(_chain([1e-3] * 3), gpu) == pytest.approx(1e-4 + 3e-3)


def test_eager_short_kernels_are_bound_by_the_launches():
    # kernels of 0.02 ms launched 0.1 ms apart: the host is the bottleneck
    gpu = _gpu(host_seconds=1e-4, profile="pytorch-eager")
    r = simulate(_chain([2e-5] * 4), gpu=gpu)
    assert r.iteration_seconds == pytest.approx(4e-4 + 2e-5)
    assert r.stall_seconds["swap_out"] == pytest.approx(0.0, abs=1e-15)
    assert host_chain_seconds([2e-5] * 4, 1e-4) == pytest.approx(4e-4 + 2e-5)


def test_nnabla_pays_the_overhead_on_the_stream():
    seq = FunctionSequence("f", batch=1)
    a, b = seq.add_variable("1MiB"), seq.add_variable("1MiB")
    seq.add_function([a], [b], flops=1e9)
    seq.add_function([b], [a], flops=1e9)
    gpu = _gpu(function_overhead_seconds=1e-4)
    assert gpu.profile == "nnabla" and gpu.host_seconds == 0.0
    r = simulate(seq, gpu=gpu)
    assert r.iteration_seconds == pytest.approx(2 * (1e-3 + 1e-4))


def test_amp_halves_activations_only():
    seq = model_sequence("resnet50", 128)
    amp = apply_precision(seq, "amp")
    assert amp.meta["precision"] == "amp" and "precision" not in seq.meta
    assert apply_precision(amp, "amp") is amp and apply_precision(seq, "fp32") is seq
    for v, w in zip(seq.variables, amp.variables):
        integer = v.name.startswith("aten.max_pool2d_with_indices") and v.name.endswith(":1")
        if v.persistent or not v.per_sample_bytes or v.name.startswith(("input", "target")) \
                or integer:
            assert w.nbytes == v.nbytes, v.name
        else:
            assert w.nbytes == v.nbytes // 2, v.name
    # the activations are most of the in-core peak: it falls by more than a third
    assert amp.in_core_peak() < 0.6 * seq.in_core_peak()
    # and the sequence scales at its precision's bytes
    assert amp.at_batch(16).in_core_peak() == apply_precision(
        model_sequence("resnet50", 16), "amp").in_core_peak()


def test_each_precision_runs_at_its_own_peak_never_above():
    for (fam, profile, precision) in CALIBRATIONS:
        gpu_name = {"v100": "v100-16gb", "p100": "p100-16gb", "a100": "a100-40gb",
                    "h100": "h100-80gb"}[fam]
        g = profiled_gpu(gpu_name, profile, precision)
        assert (g.profile, g.precision) == (profile, precision)
        assert g.peak_flops == PEAK_FLOPS[fam][precision]
        assert 0 < g.compute_efficiency <= 1
        if precision == "fp32":
            assert g.peak_flops * g.compute_efficiency <= PEAK_FLOPS[fam]["fp32"]
        if profile == "pytorch-eager":
            assert g.host_seconds == 1e-5 and g.function_overhead_seconds == 0.0
        else:
            assert g.host_seconds == 0.0 and g.function_overhead_seconds > 0


def test_the_defaults_predict_with_pytorch_eager_and_compare_with_nnabla():
    assert (profiled_gpu("v100-16gb").profile, profiled_gpu("v100-16gb").precision) == (
        "pytorch-eager", "amp")
    paper = profiled_gpu("v100-16gb", purpose="paper")
    assert (paper.profile, paper.precision) == ("nnabla", "mixed-fp32-storage")
    # the nnabla fit is today's: the raw V100 model's constants
    assert (paper.compute_efficiency, paper.function_overhead_seconds) == (0.396, 135.3e-6)
    # the P100 has only Le et al.'s (serial) calibration; the A100 only PyTorch's
    assert profiled_gpu("p100-16gb").profile == "nnabla"
    assert profiled_gpu("a100-40gb", purpose="paper").profile == "pytorch-eager"


def test_an_uncalibrated_combination_is_refused_naming_the_calibrated_ones():
    with pytest.raises(InvalidArgumentError, match="calibrated: nnabla/fp32"):
        profiled_gpu("p100-16gb", "pytorch-eager")
    with pytest.raises(InvalidArgumentError, match="no published row calibrates h100-80gb"):
        profiled_gpu("h100-80gb", "pytorch-eager", "fp32")
    with pytest.raises(InvalidArgumentError, match="unknown profile"):
        profiled_gpu("v100-16gb", "jax")


def run(capsys, *argv):
    code = main(["offload", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_simulate_prints_its_profile_precision_and_both_ratios(capsys):
    out = run(capsys, "simulate", "--batch", "48", "--budget", "1900MiB", "--window", "256MiB",
              "--gpu", "v100-16gb")
    assert "(profile pytorch-eager, precision amp)" in out
    assert "relative_speed" in out and "same_batch_compute_ratio" in out
    d = json.loads(run(capsys, "simulate", "--batch", "48", "--budget", "1900MiB", "--window",
                       "256MiB", "--gpu", "v100-16gb", "--profile", "nnabla", "--json"))
    assert (d["profile"], d["precision"]) == ("nnabla", "mixed-fp32-storage")
    assert d["same_batch_compute_ratio"] == d["speed_vs_compute_only"]
    assert d["relative_speed"] is not None


def test_table_prints_both_ratios_and_its_profile(capsys):
    out = run(capsys, "table", "--batches", "1440", "--gpu", "h100-80gb")
    assert "(profile pytorch-eager, precision amp)" in out.splitlines()[0]
    assert " rel  same " in out
    t = json.loads(run(capsys, "table", "--batches", "1440", "--gpu", "h100-80gb", "--json"))
    row = [r for r in t["rows"] if r["batch"] == 1440][0]
    assert row["window+virtual:same_batch_compute_ratio"] == row[
        "window+virtual:speed_vs_compute_only"]
    assert t["profile"] == "pytorch-eager" and t["precision"] == "amp"


def test_cli_refuses_an_uncalibrated_profile_in_one_line(capsys):
    code = main(["offload", "simulate", "--gpu", "p100-16gb", "--profile", "pytorch-eager"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "no published row calibrates p100-16gb" in err and len(err.strip().splitlines()) == 1


def test_compression_of_already_half_activations_is_refused(capsys):
    code = main(["offload", "simulate", "--batch", "64", "--compress", "fp16"])
    out, err = capsys.readouterr()
    assert code == 2 and "under precision amp the activations are already half" in err
    # under fp32 it is what it was
    d = json.loads(run(capsys, "simulate", "--batch", "64", "--compress", "fp16",
                       "--precision", "fp32", "--json"))
    assert d["precision"] == "fp32" and d["planned"]["params"]["compress"] == "fp16"


@settings(deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e-3), min_size=1, max_size=30),
       st.floats(min_value=0.0, max_value=1e-3))
def test_the_in_core_iteration_is_the_host_chain_within_its_bounds(kernels, host):
    """Any kernels and launch cost: the simulated in-core iteration is the host chain exactly,
    at least the kernels' sum and the launches' sum, at most both added."""
    gpu = _gpu(host_seconds=host, profile="pytorch-eager")
    seq = _chain(kernels)
    r = simulate(seq, gpu=gpu)
    chain = host_chain_seconds(kernels, host)
    assert r.iteration_seconds == pytest.approx(chain, rel=1e-9, abs=1e-15)
    assert in_core_seconds(seq, gpu) == pytest.approx(chain, rel=1e-9, abs=1e-15)
    n = len(kernels)
    assert chain >= max(sum(kernels), n * host) * (1 - 1e-9)
    assert chain <= (sum(kernels) + n * host) * (1 + 1e-9) + 1e-15
    if chain > 0:
        assert r.same_batch_compute_ratio == pytest.approx(1.0)


def test_paper_fit_on_nnabla_graph_is_the_calibration_it_ships():
    """The paper's in-core row fitted on nnabla's ResNet-50 (the graph it ran): the constants
    MODEL_CALIBRATIONS ships, used wherever resnet50-nnabla is simulated on the V100."""
    from vmalloc.offload.hardware.gpus import calibrate
    from vmalloc.offload.sequence.models import model_sequence
    from vmalloc.offload.simulation.profiles import MODEL_CALIBRATIONS

    eff, ov, errors = calibrate(lambda b: model_sequence("resnet50-nnabla", b))
    cal = MODEL_CALIBRATIONS[("v100", "nnabla", "mixed-fp32-storage", "resnet50-nnabla")]
    assert (eff, round(ov * 1e8) / 1e8) == (cal.efficiency, cal.overhead_seconds) == (
        0.464, 179.75e-6)
    assert max(abs(e) for e in errors.values()) < 1e-3
    g = profiled_gpu("v100-16gb", "nnabla", "mixed-fp32-storage", model="resnet50-nnabla")
    assert (g.compute_efficiency, g.function_overhead_seconds) == (0.464, 179.75e-6)
    # any other model keeps the fit on PyTorch's graph
    g = profiled_gpu("v100-16gb", "nnabla", "mixed-fp32-storage", model="resnet50")
    assert (g.compute_efficiency, g.function_overhead_seconds) == (0.396, 135.3e-6)
