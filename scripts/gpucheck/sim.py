"""The simulator_vs_measured section: vmalloc.offload's prediction of the PyTorch runs on a
model of this machine calibrated only on the measured in-core runs (as the V100 model was on
the paper's in-core row), beside what was measured.

The model starts from the ``h100-80gb`` constants (vmalloc/offload/hardware/gpus.py: peak and
HBM from the H100 datasheet, cited in reference/numbers.md); compute efficiency and per-function
overhead are fitted to the in-core runs (:func:`vmalloc.offload.hardware.gpus.calibrate`), the link
bandwidths are this machine's measured pinned figures (the bandwidth section) where there
are some, and the memory is the GPU's.
"""


def _measured_link(bandwidth):
    if not bandwidth or bandwidth.get("pinned_h2d_gbps") is None:
        return {}
    gb = 1e9
    out = {"h2d_bandwidth": bandwidth["pinned_h2d_gbps"] * gb,
           "d2h_bandwidth": bandwidth["pinned_d2h_gbps"] * gb}
    both = bandwidth.get("pinned_both_each_direction_gbps")
    if both:
        out["bidirectional_bandwidth"] = both * gb
    return out


def run(ctx):
    from vmalloc.offload import model_sequence, plan, simulate
    from vmalloc.offload.hardware.gpus import calibrate, get_gpu

    torch_result = ctx.result_of("torch_out_of_core") or {}
    core = torch_result.get("in_core") or {}
    runs = [r for r in core.get("runs") or [] if r.get("images_per_second")]
    result = {"gpu_model": None, "calibrated_on": None, "compute_efficiency": None,
              "function_overhead_seconds": None, "sequence": "resnet50 (shipped, 224x224)",
              "runs": [], "note": None}
    ran_on = "vmalloc.offload simulator (host)"
    if not runs:
        ctx.save(result, ran_on=ran_on, status="skipped",
                 reason="no measured in-core run to calibrate on (torch_out_of_core)")
        return
    points = {r["batch"]: r["images_per_second"] for r in runs}
    base = get_gpu("h100-80gb")
    efficiency, overhead, errors = calibrate(
        lambda b: model_sequence("resnet50", b), points, peak_flops=base.peak_flops,
        hbm_bandwidth=base.hbm_bandwidth)
    device = ctx.result_of("device") or {}
    changes = dict(name="this-machine", compute_efficiency=efficiency,
                   function_overhead_seconds=overhead, **_measured_link(ctx.result_of(
                       "bandwidth")))
    if device.get("memory_bytes"):
        changes["memory_bytes"] = int(device["memory_bytes"])
    gpu = base.with_(**changes)
    result.update(gpu_model=gpu.to_dict(), compute_efficiency=efficiency,
                  function_overhead_seconds=overhead,
                  calibrated_on={str(b): ips for b, ips in points.items()})
    budget = torch_result.get("budget_bytes")
    ctx.save(result, ran_on=ran_on)
    for r in runs:
        sim = simulate(model_sequence("resnet50", r["batch"]), gpu=gpu)
        result["runs"].append(_row("in_core", r, sim, errors.get(r["batch"])))
        ctx.save(result)
    for r in torch_result.get("out_of_core") or []:
        if r.get("status") != "ok" or ctx.left() < 10:
            continue
        p = plan(model_sequence("resnet50", r["batch"]), gpu=gpu, scheduler="window",
                 budget=budget)
        row = _row("out_of_core", r, p.result, None)
        row["window_bytes"] = p.params.get("window")
        row["feasible"] = p.feasible
        result["runs"].append(row)
        ctx.save(result)
    if ctx.dry_run:
        result["note"] = ("--dry-run: measured on CPU at a small input, simulated for the "
                          "224x224 sequence on an H100-based model; the ratios show the "
                          "pipeline works, not the simulator's accuracy")
    ctx.save(result)


def _row(kind, measured, sim, fit_error):
    predicted_ips = getattr(sim, "images_per_second", None)
    predicted_s = getattr(sim, "iteration_seconds", None)
    ips = measured.get("images_per_second")
    return {"kind": kind, "batch": measured["batch"], "measured_images_per_second": ips,
            "predicted_images_per_second": predicted_ips,
            "measured_iteration_seconds": measured.get("iteration_seconds"),
            "predicted_iteration_seconds": predicted_s,
            "ratio_predicted_to_measured": (predicted_ips / ips) if predicted_ips and ips
            else None, "calibration_error": fit_error}
