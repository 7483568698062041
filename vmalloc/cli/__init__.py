"""The ``vmalloc`` command line.

``vmalloc replay`` replays allocator traces through vmalloc's allocators on an emulated device
and reports peaks, utilization, driver calls and the smallest capacity that runs the trace;
``vmalloc stress`` does the same for generated patterns that break best-fit caching;
``vmalloc bench`` runs the benchmarks; ``vmalloc convert`` converts a trace to another format;
``vmalloc offload`` simulates out-of-core training (:mod:`vmalloc.offload.cli`).
Errors print one line on stderr and exit with status 2.
"""

import argparse
import importlib.util
import json
import os
import sys

from vmalloc import allocator_kinds
from vmalloc.errors import VmallocError
from vmalloc.cli.errors import CliError as _CliError
from vmalloc.cli.errors import flag_for as _flag_for
from vmalloc.cli.errors import in_cli_terms as _in_cli_terms
from vmalloc.cli.errors import prog as _prog
from vmalloc.cli.errors import user_errors as _user_errors
from vmalloc.sizes import chunk_size_problem, positive_size_argument

__all__ = ["main"]

EXIT_ERROR = 2

#: The most devices of one trace file replayed at once (auto or --device all): each device's
#: replay reads the whole file, so N devices cost N passes (a trace with one event on each of
#: 2,000 devices took 90 s). Machines hold 16 GPUs at most today.
MAX_TRACE_DEVICES = 64


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors, like every other error of the command line."""

    def error(self, message):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _allocator_names(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in allocator_kinds.NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown allocator {n!r}; choose from {', '.join(allocator_kinds.NAMES)}")
    return names


def _add_run_options(p):
    p.add_argument("--allocator", "-a", dest="allocators", action="append",
                   type=_allocator_names, metavar="{" + ",".join(allocator_kinds.NAMES) + "}",
                   help="allocator to replay through; repeat (or separate with commas) for "
                        f"several; default: all of {', '.join(allocator_kinds.NAMES)}")
    p.add_argument("--capacity", type=positive_size_argument, metavar="SIZE",
                   help="device capacity such as 16GiB; a run stops at its first "
                        "out-of-memory and reports the event (default: unlimited)")
    p.add_argument("--granularity", type=positive_size_argument, metavar="SIZE",
                   help="device allocation granularity (default 2MiB, as current GPUs)")
    p.add_argument("--chunk-size", type=positive_size_argument, metavar="SIZE",
                   help="physical chunk size of the virtual allocators, a multiple of the "
                        "granularity (default 2MiB)")
    p.add_argument("--max-split-size", type=positive_size_argument, metavar="SIZE",
                   help="the caching allocator's max_split_size (as PyTorch's)")
    p.add_argument("--policy", choices=("pytorch", "nnabla", "cupy"),
                   help="the caching allocator's policy preset (default pytorch)")
    p.add_argument("--steal-before-create", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="the virtual allocators reuse free cached chunks before creating new "
                        "ones (default: on for virtual-packed, off for virtual)")
    p.add_argument("--remap-slack", type=float, default=None, metavar="F",
                   help="virtual-packed: fraction above the peak of touched chunk slots it may "
                        "hold so that a repeating step stops remapping (default 0)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list of results instead of a table (sizes in bytes)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a plot of requested and reserved bytes over each trace, in the "
                        "format its suffix names: .png, .svg or .pdf")
    p.add_argument("--no-min-capacity", dest="min_capacity", action="store_false",
                   help="skip the search for the smallest capacity that runs the trace")
    p.add_argument("--max-probes", type=int, default=None, metavar="N",
                   help="replays the minimum-capacity search may make per allocator "
                        "(default 32)")


_FORMAT_HELP = ("the trace format: torch_snapshot, kineto, rmm_csv or vmtrace (default: detected "
                "from the file)")


def _parser():
    parser = _Parser(
        prog="vmalloc",
        description="vmalloc: a virtual-addressing GPU memory allocator. Replay allocator "
                    "traces without a GPU to see whether virtual addressing removes your "
                    "fragmentation.")
    from vmalloc import __version__

    parser.add_argument("--version", action="version", version=f"vmalloc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "replay", help="replay allocator traces through the allocators",
        description="Replay allocator traces (PyTorch memory snapshots and profiler traces, "
                    "RMM logs, .vmtrace) through each allocator ("
                    + ", ".join(allocator_kinds.NAMES) + ") on an emulated device. "
                    "With no TRACE, the traces shipped with vmalloc.")
    p.add_argument("traces", nargs="*", metavar="TRACE",
                   help="trace files, or directories of them (the ranks of one job: replayed "
                        "side by side)")
    p.add_argument("--format", help=_FORMAT_HELP)
    p.add_argument("--device", action="append", metavar="[TRACE=]DEVICE",
                   help="the device whose events to replay, for traces of several: auto (the "
                        "default: the trace's only GPU device, or each of its GPU devices), "
                        "all (every device, cpu included), a CUDA ordinal, cuda:N or cpu. "
                        "TRACE=DEVICE applies to the trace files named TRACE (as given, or "
                        "their file name) only; repeat for several")
    p.add_argument("--before-window", choices=("auto", "drop", "live"), default="auto",
                   help="memory allocated before the trace began (its frees name addresses "
                        "the trace never allocated): allocate it at the start (live), or "
                        "drop those frees (drop); auto (default): live for profiler traces, "
                        "whose counters tell what was allocated, drop for the others")
    _add_run_options(p)

    from vmalloc.replay.stress import PATTERNS

    p = sub.add_parser(
        "stress", help="replay generated patterns that break best-fit caching",
        description="Replay generated allocation patterns (the out-of-core swap pattern, "
                    "growing sizes, random sizes with long-lived survivors) through each "
                    "allocator (" + ", ".join(allocator_kinds.NAMES) + "). With no PATTERN, all of them.")
    p.add_argument("patterns", nargs="*", metavar="PATTERN",
                   help=f"one of: {', '.join(PATTERNS)}")
    p.add_argument("--seed", type=int, default=0, help="random seed of the patterns (0)")
    p.add_argument("--scale", type=int, default=1, metavar="K",
                   help="repeat each pattern K times (default 1), e.g. to measure replay "
                        "speed on millions of events")
    _add_run_options(p)

    sub.add_parser("bench", add_help=False, help="run the benchmarks (vmalloc bench --help)")
    sub.add_parser("doctor", add_help=False,
                   help="check this machine: driver, VMM, map cost, bandwidth (--json)")

    p = sub.add_parser("convert", help="convert a trace to another format",
                       description="Convert a trace file of any format vmalloc reads to "
                                   ".vmtrace or to an RMM log (.csv), as DST's name says, or "
                                   "with --to torch-snapshot to a PyTorch memory snapshot "
                                   "(the pickle torch.cuda.memory._dump_snapshot writes), "
                                   "which PyTorch's memory viewer opens.")
    p.add_argument("src", metavar="SRC", help="the trace to convert (any format vmalloc reads)")
    p.add_argument("dst", metavar="DST",
                   help="the file to write: .vmtrace, .csv (an RMM log) or, with --to "
                        "torch-snapshot, a .pickle PyTorch's memory viewer opens")
    p.add_argument("--format", help="format of SRC: " + _FORMAT_HELP)
    p.add_argument("--device", default="auto",
                   help="the device whose events to keep: auto (the default: the trace's only "
                        "GPU device), a CUDA ordinal, cuda:N or cpu")
    p.add_argument("--to", choices=("auto", "torch-snapshot"), default="auto",
                   help="the format to write: auto (the default: as DST's name says, "
                        ".vmtrace or .csv) or torch-snapshot (a pickle for "
                        "https://pytorch.org/memory_viz)")

    from vmalloc.offload.cli import add_parser as add_offload_parser

    add_offload_parser(sub)
    return parser


def _flatten(lists):
    if not lists:
        return None
    return list(dict.fromkeys(n for names in lists for n in names))


def _report(results, args):
    from vmalloc.replay import before_window_note, double_free_note, format_table

    warned = set()
    for r in results:
        if r.trace not in warned and (r.unmatched_frees or r.double_frees):
            warned.add(r.trace)
            for note in (before_window_note(r), double_free_note(r)):
                if note:
                    print(f"vmalloc {args.command}: warning: {r.trace}: {note}",
                          file=sys.stderr)

    if args.json:
        json.dump([r.to_dict() for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from vmalloc.replay.verdict import verdicts

        print(format_table(results))
        lines = verdicts(results)
        print()
        for trace, line in lines:
            print(f"{trace}: {line}" if len(lines) > 1 else line)
    if args.plot:
        from vmalloc.replay.plot import plot_results

        plot_results(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def _progress(args):
    """Progress bars on stderr: only on a terminal, and never with --json."""
    return sys.stderr.isatty() and not args.json


def _reading_bar(args):
    import contextlib

    from vmalloc.replay import reading_progress

    return reading_progress() if _progress(args) else contextlib.nullcontext()


def _check_outputs(args):
    """Refuses, before any replay, an output whose name asks for a format not written, and
    a chunk size the virtual allocator would refuse (the one rule of every command)."""
    if getattr(args, "chunk_size", None) is not None and args.command in ("replay", "stress"):
        problem = chunk_size_problem(args.chunk_size, args.granularity)
        if problem:
            raise _CliError(f"--chunk-size {problem}")
    if getattr(args, "plot", None):
        from vmalloc.replay.plot import plot_format

        try:
            plot_format(args.plot)
        except VmallocError as error:
            raise _CliError(f"--plot {args.plot}: {error}") from None


def _run(sources, args):
    """Replays each (source, name) through the chosen allocators; returns the results."""
    from vmalloc.replay import MAX_PROBES, replay

    allocators = _flatten(args.allocators) or list(allocator_kinds.NAMES)
    max_probes = MAX_PROBES if args.max_probes is None else args.max_probes
    if max_probes < 1:
        raise _CliError(f"--max-probes must be at least 1, got {max_probes}")
    progress = _progress(args)
    results = []
    for source in sources:
        results += replay(source, allocators, capacity=args.capacity,
                          granularity=args.granularity, chunk_size=args.chunk_size,
                          max_split_size=args.max_split_size, policy=args.policy,
                          steal_before_create=args.steal_before_create,
                          remap_slack=args.remap_slack,
                          min_capacity=args.min_capacity, max_probes=max_probes,
                          progress=progress)
    return results


_TRACE_SUFFIXES = (".vmtrace", ".pickle", ".pkl", ".json", ".json.gz", ".csv", ".pickle.gz",
                   ".csv.gz")


def _natural(name):
    """Sort key: rank2 before rank10."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _expand(traces):
    """TRACE arguments -> trace files: a directory stands for its trace files (by suffix), in
    natural order (rank2 before rank10)."""
    files = []
    for t in traces:
        if os.path.isdir(t):
            found = sorted((f for f in os.listdir(t) if f.lower().endswith(_TRACE_SUFFIXES)
                            and os.path.isfile(os.path.join(t, f))), key=_natural)
            if not found:
                raise _CliError(f"the directory {t} holds no trace file (*"
                                + ", *".join(_TRACE_SUFFIXES) + ")")
            files += [os.path.join(t, f) for f in found]
        else:
            files.append(t)
    return files


def _device_choices(values, files):
    """--device values -> {file: device choice}: TRACE=DEVICE for the files named TRACE (as
    given or by file name), a bare DEVICE for the others (default auto)."""
    from vmalloc.traces._fields import parse_device

    default, per = "auto", {}
    for value in values or []:
        target, sep, spec = value.rpartition("=")
        spec = spec.strip()
        if spec.lower() != "all":
            try:
                parse_device(spec)
            except VmallocError:
                raise _CliError(f"--device {value}: expected auto, all, a CUDA ordinal (0), "
                                "cuda:N or cpu, optionally after TRACE=") from None
        if not sep:
            default = spec
            continue
        matched = [f for f in files if f == target or os.path.basename(f) == target
                   or os.path.normpath(f) == os.path.normpath(target)]
        if not matched:
            raise _CliError(f"--device {value}: no TRACE named {target} on the command line")
        for f in matched:
            per[f] = spec
    return {f: per.get(f, default) for f in files}


def _plan(path, choice, args, quiet):
    """The (path, name, device) replays of one trace file for a --device choice."""
    from vmalloc.replay import _trace_name
    from vmalloc.traces import trace_devices
    from pathlib import Path

    name = _trace_name(Path(path))
    choice = choice.lower()
    if choice not in ("auto", "all"):
        return [(path, name, choice)]
    devices = trace_devices(path, format=args.format)
    if devices is None:  # a format of one device
        return [(path, name, "auto")]
    chosen = list(devices) if choice == "all" else [d for d in devices if d.startswith("cuda")]
    if choice != "all":
        from vmalloc.traces import _fast

        _fast.keep_only(chosen)  # the device count kept every device's events for its replay
    if not chosen:
        found = ", ".join(devices) or "no device"
        raise _CliError(f"{path}: no GPU memory events, only events for {found} (replay "
                        f"those with {_flag_for(path, next(iter(devices), 'cpu'))} or "
                        "--device all)")
    if len(chosen) > MAX_TRACE_DEVICES:
        raise _CliError(f"{path}: memory events for {len(chosen):,} devices; vmalloc replay "
                        f"replays at most {MAX_TRACE_DEVICES} devices of one trace (each reads "
                        f"the whole file): choose one with {_flag_for(path, chosen[0])}")
    if len(chosen) == 1:
        if not quiet and choice == "auto":
            others = [d for d in devices if d not in chosen]
            print(f"{path}: replaying {chosen[0]}, its only GPU device"
                  + (f" (it also has {', '.join(others)}: see --device)" if others else ""),
                  file=sys.stderr)
        return [(path, name, chosen[0])]
    if not quiet:
        print(f"{path}: replaying each of its devices {', '.join(chosen)} (choose one with "
              f"{_flag_for(path, chosen[0])})", file=sys.stderr)
    return [(path, f"{name} [{d}]", d) for d in chosen]


def _replay_command(args):
    from vmalloc.replay import TraceSource
    from vmalloc.traces import builtin_traces

    quiet = args.json
    if args.traces:
        files = _expand(args.traces)
        choices = _device_choices(args.device, files)
        with _reading_bar(args):  # finding a profiler trace's devices reads it once
            named = [plan for f in files for plan in _plan(f, choices[f], args, quiet)]
    else:
        if args.device:
            _device_choices(args.device, [])  # validate: a TRACE= names no file here
        named = [(path, name, "auto") for name, path in sorted(builtin_traces().items())]
        if not named:
            raise _CliError("no TRACE given and no built-in trace is installed")
    names = [n for _, n, _ in named]
    if len(set(names)) < len(names):  # the same name in two directories: use the paths
        named = [(p, p if names.count(n) > 1 else n, d) for p, n, d in named]
    with _reading_bar(args):  # opening a snapshot reads it whole
        sources = [TraceSource(t, name=name, format=args.format, device=device,
                               before_window=args.before_window) for t, name, device in named]
    _report(_run(sources, args), args)
    return 0


def _stress_command(args):
    from vmalloc.replay import TraceSource
    from vmalloc.replay.stress import PATTERNS, generate

    names = args.patterns or list(PATTERNS)
    for n in names:
        if n not in PATTERNS:
            raise _CliError(f"unknown stress pattern {n!r}; choose from {', '.join(PATTERNS)}")
    sources = [TraceSource(generate(n, seed=args.seed, scale=args.scale), name=n)
               for n in names]
    _report(_run(sources, args), args)
    return 0


def _bench_command(argv):
    if importlib.util.find_spec("vmalloc.bench") is None:
        raise _CliError("the benchmarks (module vmalloc.bench) are not part of this "
                        "installation")
    from vmalloc import bench

    code = bench.main(argv)
    return 0 if code is None else int(code)


def _convert_command(args):
    try:
        from vmalloc.traces import convert
    except ImportError:
        raise _CliError("trace conversion (vmalloc.traces.convert) is not part of this "
                        "installation") from None
    if args.to == "torch-snapshot":
        from vmalloc.traces.torch_export import snapshot_from_trace, write_snapshot

        snapshot = snapshot_from_trace(args.src, format=args.format, device=args.device)
        write_snapshot(snapshot, args.dst)
        events = len(snapshot["device_traces"][-1])
        print(f"{args.src} -> {args.dst} (a PyTorch memory snapshot: {events:,} actions, "
              f"{len(snapshot['segments']):,} live blocks; open it at "
              "https://pytorch.org/memory_viz)", file=sys.stderr)
        return 0
    convert(args.src, args.dst, format=args.format, device=args.device)
    print(f"{args.src} -> {args.dst}", file=sys.stderr)
    return 0


def main(argv=None):
    """Runs the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit
    status: 0 on success, 2 on a usage or input error (one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    prog = _prog(argv)
    try:
        if command == "bench":
            # Everything after "bench" is the benchmark's own command line.
            return _bench_command(argv[1:])
        if command == "doctor":
            from vmalloc.cli.doctor import main as doctor_main

            return doctor_main(argv[1:])
        args = _parser().parse_args(argv)
        _check_outputs(args)
        if args.command == "convert" and args.to == "auto":
            from vmalloc.traces.convert import destination_format

            destination_format(args.dst)  # before reading the source
        if args.command == "replay":
            return _replay_command(args)
        if args.command == "stress":
            return _stress_command(args)
        if args.command == "offload":
            from vmalloc.offload.cli import run as offload_run

            return offload_run(args)
        return _convert_command(args)
    except SystemExit as exit:  # argparse: --help (0) or a usage error (2)
        return exit.code if isinstance(exit.code, int) else EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`vmalloc replay | head`): not worth a message. Point stdout
        # at devnull so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except MemoryError as error:
        if isinstance(error, VmallocError):  # an allocator's OutOfMemoryError: the input's
            message = str(error)
        else:
            message = "this machine ran out of memory (MemoryError); the input is too large"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except _user_errors() as error:
        message = str(error) or type(error).__name__
        message = _in_cli_terms(error, message)
        if isinstance(error, OSError) and error.filename and error.strerror:
            message = f"{error.strerror}: {error.filename}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
