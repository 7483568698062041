"""``vmalloc offload ...``: simulate out-of-core training on a model of a GPU.

::

    vmalloc offload simulate --model resnet50 --batch 1440 --gpu v100-16gb \\
        --scheduler window --allocator virtual [--budget SIZE] [--window SIZE] [--json] [--plot F]
    vmalloc offload table --model resnet50 --gpu v100-16gb [--profile P] [--precision P] [--json]
    vmalloc offload validate [--in-core-only] [--json]
    vmalloc offload models
    vmalloc offload gpus

Errors print one line on stderr and exit with status 2 (the caller, :mod:`vmalloc.cli`,
prints them).
"""

from __future__ import annotations

import json
import os
import sys

from vmalloc.errors import VmallocError
from vmalloc.sizes import chunk_size_problem, format_size, positive_size_argument

__all__ = ["add_parser", "run", "table", "PAPER_TABLE1", "TABLE_BATCHES"]

#: The paper's Table 1 (ResNet-50, V100 16 GB): batch -> (in-core, schedule + VA) images/s.
PAPER_TABLE1 = {64: (336, 304), 128: (492, 389), 190: (581, 415), 256: (None, 424),
                512: (None, 446), 928: (None, 409), 1120: (None, 398), 1248: (None, 347),
                1440: (None, 321)}
TABLE_BATCHES = tuple(PAPER_TABLE1)


class OffloadCliError(Exception):
    """A user error phrased for the command line."""


_MODEL_HELP = ("a shipped model (vmalloc offload models lists them) or a function-sequence "
               "file (default resnet50)")
_GPU_HELP = "the GPU model (vmalloc offload gpus lists them; default v100-16gb)"

#: Schedule parameters that are byte sizes (printed human-readable; JSON keeps bytes).
_SIZE_PARAMS = ("window", "budget")


def add_parser(sub):
    """Adds ``offload`` and its subcommands to ``sub`` (an argparse subparsers object)."""
    from vmalloc.offload.cli.cli_profiles import add_profile_arguments, add_validate_parser
    from vmalloc.offload.scheduling.schedulers import SCHEDULERS
    from vmalloc.offload.simulation.simulator import ALLOCATORS

    p = sub.add_parser("offload", help="out-of-core training: train on the emulated device, "
                                       "or simulate swap schedules on a model of a GPU",
                       description="Out-of-core training: train a NumPy network under half its "
                                   "in-core memory on the emulated device (train), or simulate "
                                   "a model's training iteration under a swap schedule on a "
                                   "model of a GPU, every allocation through a real vmalloc "
                                   "allocator (simulate, table).")
    osub = p.add_subparsers(dest="offload_command", metavar="SUBCOMMAND")
    osub.required = True

    s = osub.add_parser("simulate", help="simulate one model, batch, scheduler and allocator")
    s.add_argument("--model", default="resnet50",
                   help=_MODEL_HELP)
    s.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    s.add_argument("--gpu", default="v100-16gb", help=_GPU_HELP)
    s.add_argument("--scheduler", choices=SCHEDULERS, default="window",
                   help="the swap schedule: the paper's window scheduler, the LMS or vDNN "
                        "baseline, or none (in core) (default window)")
    s.add_argument("--allocator", choices=ALLOCATORS, default="virtual",
                   help="the allocator every allocation goes through (default virtual)")
    s.add_argument("--budget", type=positive_size_argument, metavar="SIZE",
                   help="the window scheduler's budget, at most the GPU's memory (default: "
                        "tuned by simulation)")
    s.add_argument("--window", type=positive_size_argument, metavar="SIZE",
                   help="the window scheduler's window (default: tuned by simulation)")
    s.add_argument("--chunk-size", type=positive_size_argument, metavar="SIZE",
                   help="the virtual allocator's chunk, a multiple of the 2MiB granularity "
                        "(default 2MiB; the paper used 40MB, about 38MiB)")
    s.add_argument("--recompute", action="store_true",
                   help="consider recomputing cheap variables instead of swapping them")
    s.add_argument("--compress", choices=("fp16", "bf16"), default=None,
                   help="swap float32 activations at half their bytes (lossy; opt-in)")
    s.add_argument("--plan", action="store_true",
                   help="print per variable class what the planner chose (keep, swap, drop, "
                        "recompute, compress), the bytes each moves, the predicted step time "
                        "and its bottleneck")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object (sizes in bytes)")
    s.add_argument("--plot", metavar="FILE.png", help="write a timeline PNG")
    add_profile_arguments(s, "pytorch-eager (vmalloc's predictions) where calibrated")

    t = osub.add_parser("table", help="the paper's Table 1, simulated")
    t.add_argument("--model", default="resnet50", help=_MODEL_HELP)
    t.add_argument("--gpu", default="v100-16gb", help=_GPU_HELP)
    t.add_argument("--batches", default=None, metavar="B,B,...",
                   help="batch sizes (default for resnet50 the paper's: "
                        f"{','.join(map(str, TABLE_BATCHES))}; for other models 1/2, 2, 4, "
                        "8 and 10 times the in-core limit)")
    t.add_argument("--choices", action="store_true",
                   help="add columns for window+virtual with recompute considered and with fp16 "
                        "compression on top (slower: the planner tries each choice)")
    t.add_argument("--json", action="store_true", help="print one JSON object (sizes in bytes)")
    add_profile_arguments(t, "nnabla (the paper's comparison) where calibrated")
    add_validate_parser(osub)

    r = osub.add_parser("train", help="train a NumPy network out of core on the emulated "
                                      "device, under half its in-core memory")
    r.add_argument("--network", choices=("mlp", "cnn"), default="mlp",
                   help="the NumPy network to train: a multilayer perceptron or a small "
                        "convolutional network (default mlp)")
    r.add_argument("--steps", type=int, default=4,
                   help="training steps, 2 to 1000: the first is recorded, the others run "
                        "on the schedule (default 4)")
    r.add_argument("--allocator", choices=ALLOCATORS, default="virtual",
                   help="the allocator of the emulated device (default virtual)")
    r.add_argument("--fraction", type=float, default=0.5,
                   help="device capacity as a fraction of the in-core peak, rounded down to "
                        "2 MiB; one that leaves 0 bytes is refused (default 0.5)")
    r.add_argument("--recompute", action="store_true",
                   help="recompute forward activations instead of swapping them where that "
                        "moves fewer bytes (Capuchin-style; results stay bit-identical)")
    r.add_argument("--compress", choices=("fp16", "bf16"), default=None,
                   help="swap float32 activations in this format (lossy, opt-in): the run "
                        "reports its deviation from the in-core losses instead of identity")
    r.add_argument("--json", action="store_true",
                   help="print one JSON object (sizes in bytes)")

    osub.add_parser("models", help="list the shipped model sequences")
    osub.add_parser("gpus", help="list the GPU models")
    return p


def _sequence(model, batch, precision=None):
    """The model's sequence at ``batch``, its activations as ``precision`` stores them."""
    from vmalloc.offload.simulation.profiles import apply_precision

    seq = _recorded_sequence(model, batch)
    return seq if precision is None else apply_precision(seq, precision)


def _recorded_sequence(model, batch):
    from vmalloc.offload.sequence.models import MODELS, model_sequence
    from vmalloc.offload.sequence.sequence import FunctionSequence

    if model in MODELS:
        try:
            return model_sequence(model, batch)
        except VmallocError as error:
            raise OffloadCliError(f"--batch {batch}: {error}") from None
    if os.path.exists(model):
        try:
            seq = FunctionSequence.load(model)
        except VmallocError as error:   # the file's problem: say which flag named it
            raise OffloadCliError(f"--model {error}" if str(error).startswith(model)
                                  else f"--model {model}: {error}") from None
        if not seq.functions:
            raise OffloadCliError(f"--model {model}: the sequence has no functions: nothing "
                                  "to simulate")
        if seq.batch is None:
            raise OffloadCliError(f"--model {model}: the sequence records no batch size "
                                  "(\"batch\": null), so images/s and --batch do not apply; "
                                  "save it with the batch it was recorded at")
        if batch is not None and batch != seq.batch:
            try:
                seq = seq.at_batch(batch)
            except VmallocError as error:
                raise OffloadCliError(f"--batch {batch}: {error}") from None
        return seq
    raise OffloadCliError(f"--model {model}: not a shipped model ({', '.join(MODELS)}) and "
                          f"no such file")


def _gpu(name, profile=None, precision=None, purpose="predict", model=None):
    """The GPU model ``name`` with its profile's and precision's calibrated constants (those
    fitted on ``model``'s own graph where there are: the paper's on resnet50-nnabla)."""
    from vmalloc.offload.hardware.gpus import GPUS
    from vmalloc.offload.simulation.profiles import profiled_gpu

    if name.lower() not in GPUS:
        raise OffloadCliError(f"--gpu {name}: unknown GPU; choose from {', '.join(GPUS)}")
    return profiled_gpu(GPUS[name.lower()], profile, precision, purpose, model=model)


def _reference(model, gpu):
    """(in-core limit batch, its images/s) of ``model`` on ``gpu`` (at its precision's
    bytes), or None when nothing runs in core."""
    from vmalloc.offload.sequence.models import MODELS
    from vmalloc.offload.planning.planner import in_core_reference

    key = (model if model in MODELS and gpu.precision != "amp"
           else (lambda b: _sequence(model, b, gpu.precision)))
    limit, ips = in_core_reference(key, gpu)
    return (limit, ips) if limit else None


def _simulate(args):
    from vmalloc.offload.planning.planner import plan
    from vmalloc.offload.simulation.simulator import simulate

    if args.batch is not None and args.batch < 1:
        raise OffloadCliError(f"--batch must be positive, got {args.batch}")
    if args.scheduler != "window" and (args.budget is not None or args.window is not None):
        raise OffloadCliError("--budget and --window apply to --scheduler window only")
    gpu = _gpu(args.gpu, args.profile, args.precision, model=args.model)
    if args.compress and gpu.precision == "amp":
        raise OffloadCliError(f"--compress {args.compress}: under precision amp the activations "
                              "are already half precision; choose --precision fp32 (or tf32)")
    for flag, value in (("--budget", args.budget), ("--window", args.window)):
        if value is not None and value > gpu.memory_bytes:
            raise OffloadCliError(f"{flag} {format_size(value)} is above the memory of the "
                                  f"{gpu.name} ({format_size(gpu.memory_bytes)})")
    check_chunk_size(args.chunk_size)
    seq = _sequence(args.model, args.batch, gpu.precision)
    # the paper's reference: in-core images/s at the in-core limit (relative_speed divides by it)
    ref = _reference(args.model, gpu)
    p = plan(seq, gpu, args.scheduler, args.allocator, budget=args.budget, window=args.window,
             chunk_size=args.chunk_size, reference=ref, recompute=args.recompute,
             compress=args.compress)
    if p.feasible:
        r = simulate(seq, p.schedule, gpu=gpu, allocator=args.allocator,
                     chunk_size=args.chunk_size, timeline=bool(args.plot), reference=ref)
    else:
        r = p.result
        if r is None:
            raise OffloadCliError(f"no schedule fits: {p.reason}")
    if args.json:
        d = r.to_dict()
        d["planned"] = {"params": p.params, "tried": p.tried, "feasible": p.feasible,
                        "reason": p.reason}
        if args.plan and p.feasible:
            from vmalloc.offload.planning.plan_report import plan_table

            d["plan"] = plan_table(seq, p.schedule, r)
        json.dump(d, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(r.summary())
        if p.params:
            print("parameters: " + ", ".join(f"{k}={_param(k, v)}"
                                             for k, v in p.params.items()))
        if r.out_of_memory:
            print(f"out of memory: {r.oom_message}")
        if args.plan and p.feasible:
            from vmalloc.offload.planning.plan_report import format_plan, plan_table

            print(format_plan(plan_table(seq, p.schedule, r)))
    if args.plot:
        if r.timeline is None:
            raise OffloadCliError("nothing to plot: the simulation ran out of memory")
        from vmalloc.offload.simulation.timeline import plot_timeline

        plot_timeline(r, args.plot)
        print(f"timeline written to {args.plot}", file=sys.stderr)
    return 0


def _param(name, value):
    """A schedule parameter for text output: sizes human-readable."""
    if name in _SIZE_PARAMS and isinstance(value, int) and not isinstance(value, bool):
        return format_size(value)
    return value


def check_chunk_size(chunk_size, granularity=None, flag="--chunk-size"):
    """Refuses, before any work, a chunk size the virtual allocator would refuse: the one
    rule (:func:`vmalloc.sizes.chunk_size_problem`) of every command."""
    problem = chunk_size_problem(chunk_size, granularity)
    if problem:
        raise OffloadCliError(f"{flag} {problem}")


#: The columns ``table(choices=True)`` adds: window+virtual with recompute considered
#: (lossless), and with fp16 compression on top (lossy, opt-in).
CHOICE_COLUMNS = (("window+virtual+recompute", dict(recompute=True)),
                  ("window+virtual+recompute+fp16", dict(recompute=True, compress="fp16")))


def table(model="resnet50", gpu="v100-16gb", batches=None, progress=False, choices=False,
          profile=None, precision=None):
    """The paper's Table 1 for ``model`` on ``gpu``, simulated: a dict with ``rows`` (one per
    batch: images/s or None for out of memory, per configuration) and the in-core limit.
    ``choices``: also the columns of :data:`CHOICE_COLUMNS` (recompute, compression).
    ``gpu`` by name gets ``profile`` and ``precision`` (default: the paper's ``nnabla`` where
    calibrated); a :class:`GPU` is used as it is."""
    from vmalloc.offload.planning.planner import in_core_reference, plan
    from vmalloc.offload.simulation.simulator import simulate

    gpu = _gpu(gpu, profile, precision, "paper", model) if isinstance(gpu, str) else gpu
    seq_fn = (lambda b: _sequence(model, b, gpu.precision))
    limit, limit_ips = in_core_reference(seq_fn, gpu)
    if batches is None and model != "resnet50" and limit:
        # other models: multiples of their own in-core limit
        batches = [max(1, limit // 2), 2 * limit, 4 * limit, 8 * limit, 10 * limit]
    batches = sorted(set(batches or TABLE_BATCHES) | ({limit} if limit else set()))
    paper = model == "resnet50" and gpu.name.startswith("v100-16gb")
    configs = [("window", "caching", None, {}), ("window", "virtual", None, {}),
               ("lms", "virtual", None, {}), ("vdnn", "virtual", None, {})]
    if choices:
        # under amp the activations are already 16-bit: no fp16 compression column
        configs += [("window", "virtual", key, extra) for key, extra in CHOICE_COLUMNS
                    if not (extra.get("compress") and gpu.precision == "amp")]
    rows = []
    for k, b in enumerate(batches):
        if progress:
            print(f"\r{model} on {gpu.name}: batch {b} ({k + 1}/{len(batches)})",
                  end="", file=sys.stderr, flush=True)
        seq = seq_fn(b)
        inc = simulate(seq, None, gpu=gpu, allocator="caching")
        row = {"batch": b,
               "in_core": None if inc.out_of_memory else inc.images_per_second}
        ref = (limit, limit_ips) if limit else None
        for sch, alloc, key, extra in configs:
            p = plan(seq, gpu, sch, alloc, reference=ref, **extra)
            key = key or f"{sch}+{alloc}"
            if p.feasible:
                r = p.result
                row[key] = r.images_per_second
                row[key + ":params"] = p.params
                # the same figure as simulate's relative_speed (the paper's ratio)
                row[key + ":relative"] = r.relative_speed
                row[key + ":speed_vs_compute_only"] = r.speed_vs_compute_only
                row[key + ":same_batch_compute_ratio"] = r.speed_vs_compute_only
                row[key + ":bound_ratio"] = r.bound_ratio
                row[key + ":serial_bound_ratio"] = r.serial_bound_ratio
            else:
                row[key] = None
            if sch == "window" and alloc == "caching":
                r = p.result
                row["window+caching:peak_reserved_bytes"] = r.peak_reserved_bytes if r else None
                row["window+caching:budget_bytes"] = (p.params.get("budget") if p.feasible
                                                      else (r.budget_bytes if r else None))
        if paper and b in PAPER_TABLE1:
            row["paper_in_core"], row["paper_schedule_va"] = PAPER_TABLE1[b]
        rows.append(row)
    if progress:
        print(file=sys.stderr)
    from vmalloc.offload.simulation.simulator import link_description

    return {"model": model, "gpu": gpu.name, "profile": gpu.profile,
            "precision": gpu.precision, "link": link_description(gpu),
            "in_core_limit": limit,
            "in_core_limit_images_per_second": limit_ips, "rows": rows}


def _fmt(x, width=8):
    return f"{'OOM':>{width}}" if x is None else f"{x:>{width}.0f}"


def _table(args):
    from vmalloc.offload.cli.cli_profiles import ratio_cells

    batches = None
    if args.batches:
        try:
            batches = [int(b) for b in args.batches.split(",") if b.strip()]
        except ValueError:
            raise OffloadCliError(f"--batches must be integers separated by commas, got "
                                  f"{args.batches!r}") from None
        if not batches or min(batches) < 1:
            raise OffloadCliError("--batches must be positive integers")
    gpu = _gpu(args.gpu, args.profile, args.precision, "paper", args.model)
    _sequence(args.model, None)   # a clear error before any work
    t = table(args.model, gpu, batches, progress=sys.stderr.isatty() and not args.json,
              choices=args.choices)
    if args.json:
        json.dump(t, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    paper = any("paper_schedule_va" in r for r in t["rows"])
    print(f"{t['model']} on {t['gpu']} (profile {t['profile']}, precision {t['precision']}): "
          f"images/s (OOM: out of memory); in-core limit batch "
          f"{t['in_core_limit']} at {t['in_core_limit_images_per_second'] or 0:.0f} images/s; "
          f"link {t['link']}")
    head = (f"{'batch':>6} {'in-core':>8} {'win+cach':>8} {'win+virt':>8} {'rel':>5} "
            f"{'same':>5} {'lms+virt':>8} {'vdnn+vir':>8}")
    if args.choices:
        head += f" {'win+rc':>8} {'rel':>5} {'same':>5}"
        if t["precision"] != "amp":
            head += f" {'rc+fp16':>8} {'rel':>5} {'same':>5}"
    if paper:
        head += f" {'paper-ic':>8} {'paper-va':>8}"
    head += "   win+caching reserved / budget"
    print(head)
    for r in t["rows"]:
        line = (f"{r['batch']:>6} {_fmt(r['in_core'])} {_fmt(r['window+caching'])} "
                f"{_fmt(r['window+virtual'])} {ratio_cells(r, 'window+virtual')} "
                f"{_fmt(r['lms+virtual'])} {_fmt(r['vdnn+virtual'])}")
        for key, _ in (CHOICE_COLUMNS if args.choices else ()):
            if key not in r:
                continue
            line += f" {_fmt(r[key])} {ratio_cells(r, key)}"
        if paper:
            line += "".join(f" {'-':>8}" if r.get(k) is None else f" {r[k]:>8}"
                            for k in ("paper_in_core", "paper_schedule_va"))
        res, bud = r.get("window+caching:peak_reserved_bytes"), r.get("window+caching:budget_bytes")
        if res is not None and bud:
            line += f"   {format_size(res)} / {format_size(bud)}"
        print(line)
    print("rel: relative_speed, window+virtual against the in-core speed at the in-core limit "
          "(the paper's metric: its 55 % at 1440 is 321/581); same: same_batch_compute_ratio, "
          "this batch's compute-only time over its iteration time")
    if args.choices:
        print("win+rc: window+virtual with recompute considered (lossless); rc+fp16: and float32 "
              "activations swapped as fp16 (lossy, opt-in)")
    return 0


def _models(args):
    from vmalloc.offload.sequence.models import MODELS, model_sequence

    for name in MODELS:
        print(model_sequence(name).summary())
    return 0


def _gpus(args):
    from vmalloc.offload.cli.cli_profiles import print_gpus

    return print_gpus()


def _train(args):
    import json

    from vmalloc.frameworks.numpy_training import MAX_STEPS, compare

    if args.steps < 2:
        raise OffloadCliError(f"--steps must be at least 2 (one recorded iteration, one "
                              f"scheduled), got {args.steps}")
    if args.steps > MAX_STEPS:
        raise OffloadCliError(f"--steps must be at most {MAX_STEPS:,} (each step's data is "
                              f"made up front), got {args.steps}")
    if not 0 < args.fraction <= 1:
        raise OffloadCliError(f"--fraction must be in (0, 1], got {args.fraction}")
    try:
        r = compare(args.network, args.steps, args.fraction, args.allocator,
                    recompute=args.recompute, compress=args.compress)
    except VmallocError as error:
        if str(error).startswith("fraction "):   # the device it leaves is empty
            raise OffloadCliError(f"--{error}") from None
        raise
    ok = r["identical"] or args.compress is not None   # compressed: lossy by request
    if args.json:
        print(json.dumps(r))
        return 0 if ok else 1
    st = r["stats"]
    print(f"{r['network']} on the emulated device ({r['allocator']} allocator): in-core peak "
          f"{format_size(r['in_core_peak_bytes'])}; out of core on a device of "
          f"{format_size(r['capacity_bytes'])} (budget {format_size(r['budget_bytes'])})")
    print(f"  losses in core     {[round(x, 6) for x in r['in_core_losses']]}  "
          f"({r['in_core_seconds']:.2f} s)")
    print(f"  losses out of core {[round(x, 6) for x in r['out_of_core_losses']]}  "
          f"({r['out_of_core_seconds']:.2f} s)")
    print(f"  losses and final weights bit-identical: {r['identical']}")
    if args.compress:
        d = r["deviation"]
        print(f"  {args.compress} swaps: {st['compressed_swap_outs']} compressed; losses off by "
              f"at most {d['max_abs']:.3g} ({d['max_rel']:.3g} relative), final weights by "
              f"{d['weight_max_abs']:.3g}")
    print(f"  peak device bytes {format_size(st['peak_device_bytes'])}, swapped out "
          f"{format_size(st['swapped_out_bytes'])}, swapped in "
          f"{format_size(st['swapped_in_bytes'])}")
    print(f"  iterations {st['iterations']} (recorded {st['recorded_iterations']}, scheduled "
          f"{st['scheduled_iterations']}): scheduled swap-outs {st['scheduled_swap_outs']}, "
          f"swap-ins {st['scheduled_swap_ins']}, on demand {st['on_demand_swap_ins']}")
    if st["recomputed_functions"]:
        print(f"  recomputed functions {st['recomputed_functions']} (buffers dropped "
              f"{st['recompute_drops']})")
    print("Simulate a GPU: vmalloc offload table --model resnet50 --gpu v100-16gb")
    return 0 if ok else 1


def run(args):
    """Runs the parsed ``offload`` command; returns the exit status. Raises OffloadCliError
    (and VmallocError, OSError) for the caller to print as one line."""
    from vmalloc.offload.cli.cli_profiles import run_validate

    return {"simulate": _simulate, "table": _table, "train": _train, "models": _models,
            "gpus": _gpus, "validate": run_validate}[args.offload_command](args)
