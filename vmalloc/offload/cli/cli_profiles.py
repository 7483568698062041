"""The command line's profile and precision options, and ``vmalloc offload validate``.

Kept apart from :mod:`vmalloc.offload.cli` (which calls these): ``--profile`` and
``--precision`` on ``simulate`` and ``table``, the ``validate`` subcommand, and the profile
lines of ``vmalloc offload gpus``.
"""

from __future__ import annotations

import json
import sys

from vmalloc.offload.simulation.profiles import PRECISIONS, PROFILES

__all__ = ["add_profile_arguments", "add_validate_parser", "run_validate", "gpu_profile_lines",
           "print_gpus", "ratio_cells"]


def add_profile_arguments(parser, default_text):
    """``--profile`` and ``--precision`` on ``parser``; ``default_text`` says the defaults."""
    parser.add_argument("--profile", choices=tuple(PROFILES), default=None,
                        help="the framework's compute profile: nnabla (host cost per function "
                             "not hidden, the paper's) or pytorch-eager (launches run ahead of "
                             f"the GPU); default {default_text}")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="fp32 (FP32 peak), tf32, amp (tensor cores, half the activation "
                             "bytes) or mixed-fp32-storage (the paper's nnabla fit); default: "
                             "amp where the profile is calibrated for it")


def add_validate_parser(osub):
    v = osub.add_parser("validate", help="every published row beside its simulation, with the "
                                         "signed error and whether it calibrated or validates")
    v.add_argument("--in-core-only", action="store_true",
                   help="only the in-core rows (fast; the out-of-core rows plan each batch)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    return v


def run_validate(args):
    from vmalloc.offload.simulation.published import ROWS
    from vmalloc.offload.planning.validate import format_validation, validate

    rows = [r for r in ROWS if r.run == "in-core"] if args.in_core_only else None
    v = validate(rows, progress=sys.stderr.isatty() and not args.json)
    if args.json:
        json.dump(v, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_validation(v))
    return 0


def gpu_profile_lines(gpu):
    """``vmalloc offload gpus``: one line per calibrated profile and precision of ``gpu``."""
    from vmalloc.offload.simulation.profiles import CALIBRATIONS, family, profiled_gpu

    fam = family(gpu)
    out = []
    for (f, profile, precision), cal in CALIBRATIONS.items():
        if f != fam:
            continue
        g = profiled_gpu(gpu, profile, precision)
        out.append(f"    {profile:<13} {precision:<18} {g.peak_flops / 1e12:>5.1f} TFLOP/s x "
                   f"{g.compute_efficiency:.3f}, {g.function_overhead_seconds * 1e6:.1f} us/"
                   f"function on the stream, {g.host_seconds * 1e6:.1f} us/function on the "
                   f"host: {cal.source}")
    return out


def print_gpus():
    """``vmalloc offload gpus``: each raw GPU model, then its calibrated profiles."""
    from vmalloc.offload.hardware.gpus import GPUS
    from vmalloc.sizes import format_size

    for g in GPUS.values():
        print(f"{g.name:<10} {format_size(g.memory_bytes)}, {g.peak_flops / 1e12:.0f} TFLOP/s "
              f"x {g.compute_efficiency:.3f}, HBM {g.hbm_bandwidth / 1e9:.0f} GB/s, {g.link}: "
              f"H2D {g.h2d_bandwidth / 1e9:.1f} / D2H {g.d2h_bandwidth / 1e9:.1f} / both "
              f"{g.bidirectional_bandwidth / 1e9:.1f} GB/s, "
              f"{g.function_overhead_seconds * 1e6:.0f} us/function (raw model)")
        for line in gpu_profile_lines(g):
            print(line)
    return 0


def ratio_cells(row, key):
    """``relative_speed`` and ``same_batch_compute_ratio`` of ``key`` in a table row, side by
    side: never one ratio alone."""
    rel, same = row.get(key + ":relative"), row.get(key + ":same_batch_compute_ratio")
    return (f"{'' if rel is None else format(rel, '.0%'):>5} "
            f"{'' if same is None else format(same, '.0%'):>5}")
