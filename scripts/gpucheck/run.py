"""The runner of scripts/gpu-check: steps, their time limits, the budget, report.json.

Each step has its own limit; a step that fails, crashes or runs past its limit is recorded
and the next one runs. A top-level budget skips the steps it can no longer afford (saying
so). report.json is rewritten after every step, so a run killed from outside still leaves
a report of what it finished.
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpucheck import build as build_step
from gpucheck import png
from gpucheck.schema import SECTION_KEYS, SECTIONS, conform

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

#: Step -> (limit seconds, limit with --quick). Run in this order: the most telling first,
#: the test suite last (it takes whatever the budget has left, up to its limit).
LIMITS = {
    "build": (300, 300),
    "device": (60, 45),
    "driver_costs": (60, 30),
    "bandwidth": (45, 30),
    "torch_out_of_core": (330, 120),
    "timeline": (30, 15),
    "simulator_vs_measured": (90, 60),
    "tests": (240, 60),
}
ORDER = tuple(LIMITS)
#: A step is skipped rather than started with less than this many seconds left.
MIN_START = 15
DEFAULT_BUDGET = 480


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def empty_section(limit):
    return {"status": "pending", "ran_on": None, "reason": None, "seconds": None,
            "limit_seconds": limit, "error": None, "result": None}


class Report:
    """report.json, written after every change."""

    def __init__(self, out, args, limits):
        self.path = Path(out) / "report.json"
        self.start = time.monotonic()
        self.data = {
            "tool": "scripts/gpu-check", "started": _now(), "finished": None,
            "elapsed_seconds": 0.0, "dry_run": args.dry_run, "quick": args.quick,
            "budget_seconds": args.budget, "argv": sys.argv[1:], "host": os.uname().nodename,
            "python": sys.version.split()[0],
            "sections": {name: empty_section(limits[name]) for name in SECTIONS},
        }
        self.write()

    def section(self, name):
        return self.data["sections"][name]

    def write(self):
        self.data["elapsed_seconds"] = round(time.monotonic() - self.start, 2)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def _tail(text, n=3000):
    text = text or ""
    return text[-n:]


def run_child(name, args, env, limit, out):
    """Runs ``python -m gpucheck.section name`` with a time limit; returns (status, payload
    dict or None, error text)."""
    result_file = Path(out) / f"section-{name}.json"   # the child's own record
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gpucheck.section", name, "--report",
           str(Path(out) / "report.json"), "--result", str(result_file), "--out", str(out)]
    if args.dry_run:
        cmd.append("--dry-run")
    if args.quick:
        cmd.append("--quick")
    cmd += ["--budget", str(args.torch_budget), "--deadline-seconds", str(max(1, limit - 10))]
    # The child's working directory is the output folder: never the repository root, whose
    # ./vmalloc (no compiled modules) would shadow the build. Its own session, so that a
    # timeout ends the children it started too (pytest, a build).
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return "timeout", _read(result_file), (f"ran past its {limit} s limit; stderr: "
                                               f"{_tail(stderr, 1500)}")
    payload = _read(result_file)
    if proc.returncode != 0 or payload is None:
        return "failed", payload, (f"exit status {proc.returncode}; stderr: "
                                   f"{_tail(stderr, 3000)}")
    return "ok", payload, None


def _read(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def child_env(args, python_path):
    env = dict(os.environ)
    paths = [str(SCRIPTS)]
    if python_path:
        paths.insert(0, str(python_path))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Deterministic cuBLAS for the correctness comparison (read when CUDA initializes).
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("PYTHONHASHSEED", "0")
    if args.dry_run:
        env["VMALLOC_TEST_NO_GPU"] = "1"
    return env


def _apply(section, status, payload, error, seconds):
    section["status"] = status
    section["seconds"] = round(seconds, 2)
    section["error"] = error
    if payload:
        section["ran_on"] = payload.get("ran_on")
        section["reason"] = payload.get("reason")
        if payload.get("status") == "skipped" and status == "ok":
            section["status"] = "skipped"
        if payload.get("error") and status == "ok":
            section["status"], section["error"] = "failed", payload["error"]


def run_step(name, report, args, env, limit, out):
    section = report.section(name)
    start = time.monotonic()
    payload = None
    try:
        if name == "build":
            status, payload, error = "ok", build_step.run(args, limit, out), None
            if payload.get("error"):
                status, error = "failed", payload["error"]
        elif name == "timeline":
            status, payload, error = "ok", png.timeline_step(out), None
        else:
            status, payload, error = run_child(name, args, env, limit, out)
    except Exception as exc:  # noqa: BLE001 - recorded; the next step runs
        status, error = "failed", f"{type(exc).__name__}: {exc}"
    _apply(section, status, payload, error, time.monotonic() - start)
    if payload and payload.get("result") is not None:
        result, extra = conform(name, payload["result"])
        if extra:
            section["error"] = (section["error"] or "") + f" (unexpected keys {extra})"
        section["result"] = result
    report.write()
    return section


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description="Prove vmalloc on this machine's GPU in one command: build, device, test "
                    "suites on the real driver, driver costs, bandwidth, PyTorch out of core, "
                    "simulator vs measured, a timeline PNG. Writes DIR/report.json after every "
                    "step. See docs/gpu_check.rst.")
    p.add_argument("--out", default="gpu-check-out", help="output folder (default %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the driver emulator stands in for CUDA, PyTorch runs on CPU "
                        "with the poison backend")
    p.add_argument("--quick", action="store_true", help="shorten every step")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole run (default {DEFAULT_BUDGET}; steps that no "
                        "longer fit are skipped, saying so)")
    p.add_argument("--build", choices=("auto", "dev", "pip", "none"), default="auto",
                   help="how to get vmalloc: auto (reuse an importable build, else dev), dev "
                        "(scripts/dev-build gpu-check), pip (pip install --no-build-isolation "
                        "--no-deps .), none (use what is importable)")
    p.add_argument("--torch-budget", default="16GiB",
                   help="device budget B of the PyTorch section (default %(default)s, the "
                        "paper's V100)")
    p.add_argument("--only", default=None,
                   help="comma-separated steps to run (the others are skipped, saying so)")
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = DEFAULT_BUDGET
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Children run in the output folder: a relative PYTHONPATH must not change meaning.
    if os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            str(Path(p).resolve()) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    limits = {name: LIMITS[name][1 if args.quick else 0] for name in ORDER}
    for stale in ("timeline.json", "timeline.png"):   # of an earlier run into DIR
        (out / stale).unlink(missing_ok=True)
    report = Report(out, args, limits)
    only = set(args.only.split(",")) if args.only else None
    deadline = report.start + args.budget
    env = None
    for name in ORDER:
        left = max(0.0, deadline - time.monotonic())
        section = report.section(name)
        if only is not None and name not in only:
            section.update(status="skipped", reason=f"not in --only {args.only}")
        elif name != "build" and report.section("build")["status"] in ("failed", "timeout"):
            section.update(status="skipped", reason="vmalloc did not build (see build)")
        elif left < MIN_START:
            section.update(status="skipped",
                           reason=f"budget: {left:.0f} s of {args.budget:.0f} s left, too "
                                  f"little to start (a step needs {MIN_START} s)")
        else:
            limit = int(min(limits[name], left))
            section["limit_seconds"] = limit
            print(f"gpu-check: {name} (limit {limit} s) ...", flush=True)
            run_step(name, report, args, env, limit, out)
        if name == "build":
            env = child_env(args, (report.section("build")["result"] or {}).get("python_path"))
        report.write()
    report.data["finished"] = _now()
    report.write()
    print("\n".join(table(report.data)))
    print(f"report: {report.path}")
    return 0


def headline(name, r):
    """The section's main figures in a few words, for the table (None if it has none)."""
    if not r:
        return None
    try:
        if name == "device":
            return (f"{r['name']}, {r['memory_bytes'] / 2**30:.0f} GiB, driver "
                    f"{r['driver_version_text']}, CC {r['compute_capability']}, VMM "
                    f"{r['vmm_supported']}, granularity {r['granularity_minimum_bytes']}")
        if name == "tests":
            return (f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, "
                    f"{r['errors']} errors on {','.join(r['device_kinds'])}")
        if name == "driver_costs":
            c = r["calls"]
            return "2 MiB: " + ", ".join(
                f"{k.replace('cuMem', '')} {c[k]['2097152']['median_us']:.1f}" for k in
                ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap")) + " us"
        if name == "bandwidth":
            return (f"pinned H2D {r['pinned_h2d_gbps']:.1f}, D2H {r['pinned_d2h_gbps']:.1f}, "
                    f"both {r['pinned_both_each_direction_gbps']:.1f}, pageable H2D "
                    f"{r['pageable_h2d_gbps']:.1f} GB/s")
        if name == "torch_out_of_core":
            core = r["in_core"]["runs"][0]
            parts = [f"in core b={core['batch']} {core['images_per_second']:.0f} img/s"]
            for o in r["out_of_core"] or []:
                speed = o.get("relative_speed")
                parts.append(f"{o['factor']}x b={o['batch']} " + (
                    f"{speed:.2f}" if speed is not None else str(o["status"])[:40]))
            c = r["correctness"] or {}
            parts.append(f"identical {c.get('identical')}")
            g = (r.get("gpt2") or {}).get("runs") or {}
            ratios = [f"{name.replace('out_of_core_', '')} {e['ratio_to_plain']:.2f}x"
                      for name, e in g.items() if e.get("ratio_to_plain") is not None
                      and name != "plain"]
            if ratios:
                parts.append("GPT-2 " + ", ".join(ratios))
            return "; ".join(parts)
        if name == "simulator_vs_measured":
            if not any(x["ratio_predicted_to_measured"] for x in r["runs"]):
                return None
            return "predicted/measured " + ", ".join(
                f"{'in' if x['kind'] == 'in_core' else 'ooc'} b={x['batch']} "
                f"{x['ratio_predicted_to_measured']:.2f}"
                for x in r["runs"] if x["ratio_predicted_to_measured"])
    except (KeyError, TypeError, IndexError, ZeroDivisionError):
        return None
    return None


def _one_line(error):
    """An error on one line: its first line and, for a traceback, its last (the exception)."""
    if not error:
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0][:40]} ... {lines[-1]}"


def table(data):
    """The short table printed last: one line per section."""
    lines = [f"gpu-check: {data['elapsed_seconds']:.0f} s of a {data['budget_seconds']:.0f} s "
             f"budget{' (dry run)' if data['dry_run'] else ''}"]
    for name in SECTIONS:
        s = data["sections"][name]
        secs = "-" if s["seconds"] is None else f"{s['seconds']:.0f}s"
        note = _one_line(s["error"]) or headline(name, s["result"]) or s["reason"] \
            or s["ran_on"] or ""
        lines.append(f"  {name:22} {s['status']:8} {secs:>5}  {str(note)[:150]}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
