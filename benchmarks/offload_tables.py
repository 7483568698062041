"""The paper's Table 1 for every shipped model on several GPU models, with recompute and
compression as their own columns (issue 16), as Markdown for docs/benchmarks.md.

    python -P benchmarks/offload_tables.py --models unet,gpt2-medium --gpus a100-40gb,h100-80gb
    python -P benchmarks/offload_tables.py --from-json DIR   # format saved
                                                              # `vmalloc offload table --choices --json`

Each table is ``vmalloc offload table --model M --gpu G --choices``: images/s per batch for
in-core, the window scheduler on the caching and the virtual allocator, LMS and vDNN on the
virtual allocator, then window+virtual with recompute considered (lossless) and with fp16
compression on top (lossy, opt-in; no such column under amp, whose activations are 16-bit
already). In parentheses: relative_speed (the paper's ratio, over the in-core images/s at the
in-core limit) / same_batch_compute_ratio (this batch's compute-only time over its iteration
time): never one alone. The heading names the profile and precision.
"""

import argparse
import json
import pathlib
import sys

COLUMNS = [("in_core", "in-core"), ("window+caching", "win+caching"),
           ("window+virtual", "win+virtual"), ("lms+virtual", "LMS+virtual"),
           ("vdnn+virtual", "vDNN+virtual"), ("window+virtual+recompute", "win+recompute"),
           ("window+virtual+recompute+fp16", "win+recompute+fp16")]
RELATIVE = ("window+virtual", "window+virtual+recompute", "window+virtual+recompute+fp16")


def markdown(t):
    lines = [f"**{t['model']} on `{t['gpu']}`** (profile {t.get('profile', 'nnabla')}, precision "
             f"{t.get('precision', 'mixed-fp32-storage')}; link {t['link']}; in-core limit batch "
             f"{t['in_core_limit']} at {t['in_core_limit_images_per_second'] or 0:.0f} "
             "images/s)", ""]
    columns = [(k, n) for k, n in COLUMNS if any(k in r for r in t["rows"])]
    lines.append("| batch | " + " | ".join(name for _, name in columns) + " |")
    lines.append("|---" * (len(columns) + 1) + "|")
    for r in t["rows"]:
        cells = [str(r["batch"])]
        for key, _ in columns:
            v = r.get(key)
            cell = "OOM" if v is None else f"{v:.0f}"
            rel = r.get(key + ":relative") if key in RELATIVE else None
            same = r.get(key + ":same_batch_compute_ratio", r.get(key + ":speed_vs_compute_only"))
            if v is not None and rel is not None:
                cell += f" ({rel:.0%} / {same:.0%})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,densenet121,unet,gpt2-medium")
    ap.add_argument("--gpus", default="v100-16gb,a100-40gb,h100-80gb")
    ap.add_argument("--from-json", metavar="DIR",
                    help="format saved tables (MODEL-GPU.json) instead of simulating")
    args = ap.parse_args(argv)
    if args.from_json:
        tables = [json.loads(p.read_text()) for p in sorted(pathlib.Path(args.from_json)
                                                            .glob("*.json"))]
    else:
        from vmalloc.offload.cli import table
        tables = [table(m, g, choices=True) for m in args.models.split(",")
                  for g in args.gpus.split(",")]
    for t in tables:
        print(markdown(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
