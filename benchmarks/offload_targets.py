"""Issue 16's targets, measured by simulation (each line names the GPU model and its link).

    PYTHONPATH=build/NAME/python python benchmarks/offload_targets.py [--only NAME ...]

Targets: v100-16gb ResNet-50 at batch 1440 >= 60 % of in-core at the in-core limit; the largest
batch at >= 50 % >= 1600; the swap-only schedule at 1440 <= 113 GB out; h100-80gb at batch 2048
>= 2 x 536 images/s; window >= 1.2 x LMS at batch >= 928; simulated LMS on p100-16gb against Le
et al.'s published LMS rows (batch 775: 130 images/s swap only, 165 with fp16 HalfComp).
"""

import argparse
import time

from vmalloc.offload.sequence.models import model_sequence
from vmalloc.offload.planning.planner import in_core_reference, plan

GB = 1e9


def show(label, p, seq):
    r = p.result
    if not p.feasible:
        print(f"{label}: no feasible plan ({p.reason})", flush=True)
        return None
    moved = sum(seq.nbytes(v) for v in p.schedule.dropped()) if p.schedule else 0
    print(f"{label} ({r.profile}, {r.precision}): {r.images_per_second:.1f} images/s, "
          f"relative_speed {r.relative_speed:.3f}, same_batch_compute_ratio "
          f"{r.same_batch_compute_ratio:.3f} "
          f"(in-core limit batch {r.in_core_limit_batch} at "
          f"{r.in_core_limit_images_per_second:.1f}); out {r.swapped_out_bytes / GB:.2f} GB, "
          f"in {r.swapped_in_bytes / GB:.2f} GB, dropped {moved / GB:.2f} GB; recomputed "
          f"functions {r.recomputed_functions}; params {p.params}; tried {p.tried}; link "
          f"{r.link}", flush=True)
    return r


def run(name, gpu, batch, scheduler="window", **kw):
    ref = in_core_reference("resnet50", gpu)
    seq = model_sequence("resnet50", batch)
    t = time.perf_counter()
    p = plan(seq, gpu, scheduler, "virtual", reference=ref, **kw)
    r = show(f"{name} [{gpu}, batch {batch}, {scheduler}, {kw or 'swap only'}; "
             f"{time.perf_counter() - t:.0f} s]", p, seq)
    return r


TARGETS = {
    "v100-1440": lambda: (run("v100 1440 recompute", "v100-16gb", 1440, recompute=True),
                          run("v100 1440 swap only", "v100-16gb", 1440)),
    "v100-largest": lambda: [run(f"v100 {b} recompute", "v100-16gb", b, recompute=True)
                             for b in (1600, 1750, 1900)],
    "h100-2048": lambda: (run("h100 2048 recompute", "h100-80gb", 2048, recompute=True),
                          run("h100 2048 swap only", "h100-80gb", 2048)),
    "window-vs-lms": lambda: [(run(f"v100 {b} window", "v100-16gb", b),
                               run(f"v100 {b} window recompute", "v100-16gb", b, recompute=True),
                               run(f"v100 {b} lms", "v100-16gb", b, "lms"))
                              for b in (928, 1440)],
    "p100-lms": lambda: (run("p100 775 lms", "p100-16gb", 775, "lms"),
                         run("p100 775 lms fp16", "p100-16gb", 775, "lms", compress="fp16"),
                         run("p100 775 lms, recopies (drop off)", "p100-16gb", 775, "lms",
                             drop=False),
                         run("p100 928 lms", "p100-16gb", 928, "lms"),
                         run("p100 775 window", "p100-16gb", 775)),
}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=list(TARGETS))
    args = ap.parse_args()
    for k in args.only or TARGETS:
        TARGETS[k]()
