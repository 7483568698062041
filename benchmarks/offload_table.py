"""The out-of-core engine against its targets (docs/benchmarks.md, "Out-of-core engine").

    PYTHONPATH=build/<name>/python python -P benchmarks/offload_table.py [--quick]

Simulates the paper's Table 1 (ResNet-50, V100 16 GB), the largest batches by scheduler and
allocator (AccUDNN's tuner, by simulation), the bound ratio at batch 1440, and the same table
for the other shipped models and GPUs. Deterministic: no timing enters a figure except the
wall time printed for the table; the figures change only with the models, the allocators and
the schedulers. ``--quick`` skips the other models and GPUs.
"""

import sys
import time

from vmalloc.offload import model_sequence, plan, simulate
from vmalloc.offload.cli import table
from vmalloc.offload.sequence.models import MODELS
from vmalloc.offload.planning.planner import in_core_reference, max_batch


def show(t):
    cols = ["in_core", "window+caching", "window+virtual", "lms+virtual", "vdnn+virtual"]
    print(f"{t['model']} on {t['gpu']} (profile {t['profile']}, precision {t['precision']}): "
          f"images/s; in-core limit batch {t['in_core_limit']} "
          f"({t['in_core_limit_images_per_second'] or 0:.0f} images/s)")
    print(f"{'batch':>6}" + "".join(f"{c:>15}" for c in cols) + f"{'rel':>6}{'same':>6}{'paper':>7}"
          f"{'caching reserved/budget':>26}")
    for r in t["rows"]:
        cells = "".join(f"{'OOM' if r[c] is None else format(r[c], '.0f'):>15}" for c in cols)
        rel = r.get("window+virtual:relative")
        same = r.get("window+virtual:same_batch_compute_ratio")
        res, bud = r.get("window+caching:peak_reserved_bytes"), r.get("window+caching:budget_bytes")
        rb = f"{res / 2**30:.2f}/{bud / 2**30:.2f} GiB" if res and bud else ""
        paper = r.get("paper_schedule_va")
        print(f"{r['batch']:>6}{cells}{'' if rel is None else format(rel, '.0%'):>6}"
              f"{'' if same is None else format(same, '.0%'):>6}"
              f"{'-' if paper is None else paper:>7}{rb:>26}")


def main(quick=False):
    t0 = time.perf_counter()
    t = table("resnet50", "v100-16gb")
    print(f"[table in {time.perf_counter() - t0:.1f} s]")
    show(t)
    rows = {r["batch"]: r for r in t["rows"]}

    print("\nlargest batch (doubling from 128, then bisection to 2 %):")
    ref_b, ref = in_core_reference("resnet50")
    print(f"  in-core: {ref_b} at {ref:.0f} images/s")
    for sch, alloc, m in (("window", "caching", 0.0), ("window", "virtual", 0.0),
                          ("window", "virtual", 0.55), ("lms", "virtual", 0.0),
                          ("vdnn", "virtual", 0.0)):
        b, p = max_batch("resnet50", "v100-16gb", sch, alloc, min_relative_speed=m, start=128)
        ips = p.result.images_per_second if p else 0
        print(f"  {sch}+{alloc} at >= {m:.0%} of in-core: batch {b} ({b / ref_b:.1f}x), "
              f"{ips:.0f} images/s, {p.params if p else ''}")

    for b in (928, 1120, 1248, 1440):
        w, l = rows[b]["window+virtual"], rows[b]["lms+virtual"]
        print(f"  batch {b}: window+virtual / lms+virtual = "
              + ("LMS OOM" if l is None else f"{w / l:.2f}x"))

    seq = model_sequence("resnet50", 1440)
    p = plan(seq, "v100-16gb", "window", "virtual")
    r = simulate(seq, p.schedule, gpu="v100-16gb", allocator="virtual")
    print(f"\nbatch 1440 window+virtual: iteration {r.iteration_seconds:.3f} s, compute "
          f"{r.compute_seconds:.3f} s, stalls {r.stall_seconds}")
    print(f"  bound max(compute, bytes/link) {r.bound_seconds:.3f} s (x{r.bound_ratio:.3f}); "
          f"serial bound {r.serial_bound_seconds:.3f} s (x{r.serial_bound_ratio:.3f}); "
          f"swapped {r.swapped_out_bytes / 1e9:.1f} GB each way")
    r40 = simulate(seq, p.schedule, gpu="v100-16gb", allocator="virtual", chunk_size="40MB")
    print(f"  with 40 MiB chunks (the paper's): {r40.images_per_second:.0f} images/s, "
          f"reserved {r40.peak_reserved_bytes / 2**30:.2f} GiB, OOM {r40.out_of_memory}")
    if quick:
        return
    for model in MODELS:
        if model == "resnet50":
            continue
        print()
        show(table(model, "v100-16gb"))
    for gpu in ("a100-40gb", "h100-80gb"):
        print()
        show(table("resnet50", gpu, batches=[190, 512, 928, 1440, 2048, 4096]))


if __name__ == "__main__":
    main("--quick" in sys.argv[1:])
