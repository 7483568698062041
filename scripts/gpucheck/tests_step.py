"""The tests section: the suites parametrized over devices, on the real GPU's ``cuda`` kind
(tests/conftest.py adds it where a GPU is present), and the GPU examples (PyTorch, CuPy and
the C ABI on the real driver). Under --dry-run the same suites run on the driver emulator."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The suites whose device fixture (tests/conftest.py ``make_device``) is parametrized over
#: device kinds, the first one alone under --quick.
SUITES = ("tests/device/test_device_protocol.py", "tests/offload/test_swap_state_machine.py",
          "tests/alloc/test_allocator_protocol.py")
#: Tests that run only where a GPU is (they skip elsewhere): PyTorch training on vmalloc with
#: no driver call after warm-up (examples/gpu/torch_train_step.py), CuPy arrays on vmalloc.
GPU_TESTS = ("tests/integration/test_torch_integration.py::test_cuda_torch_training_step_on_a_gpu",
             "tests/integration/test_cupy_integration.py::test_cupy_arrays_on_a_gpu")
EXAMPLES = ("examples/gpu/cuda_device_basics.py", "examples/gpu/cupy_example.py")

_LAUNCH = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
           "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def parse(output):
    """Counts and failures' names from ``pytest -v -rA`` output (complete or cut short)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures = []
    seen = set()
    for line in output.splitlines():
        m = _LINE.match(line.strip())
        if not m or (m.group(1), m.group(2)) in seen:
            continue
        seen.add((m.group(1), m.group(2)))
        word = m.group(2)
        if word in ("PASSED", "XPASS"):
            counts["passed"] += 1
        elif word in ("SKIPPED", "XFAIL"):
            counts["skipped"] += 1
        elif word == "FAILED":
            counts["failed"] += 1
            failures.append(m.group(1))
        else:
            counts["errors"] += 1
            failures.append(m.group(1))
    return counts, failures


def _run(cmd, env, limit):
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1, limit))
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, True


def run(ctx):
    kind = "cuda-emulator" if ctx.dry_run else "cuda"
    # One pytest per suite, the quick and telling ones first: on an H200 the allocator suite
    # ran past the step's time and a single pytest killed there printed no failure at all.
    suites = (SUITES[:1] if ctx.quick else (SUITES[0],) + GPU_TESTS + SUITES[1:])
    if ctx.dry_run:
        suites = tuple(x for x in suites if x not in GPU_TESTS)
    env = dict(os.environ, VMALLOC_TEST_DEVICE_KINDS=kind, HYPOTHESIS_PROFILE="ci")
    # pytest from the repository root without the root on sys.path (python -m would put it
    # first, and ./vmalloc has no compiled modules).
    opts = ["-v", "-rA", "--tb=short", "-p", "no:cacheprovider"]
    result = {"command": f"VMALLOC_TEST_DEVICE_KINDS={kind} python -m pytest "
                         + " ".join(opts) + " SUITE, for each of " + " ".join(suites),
              "device_kinds": [kind], "passed": 0, "failed": 0, "skipped": 0, "errors": 0,
              "failures": [], "examples": {}, "output_tail": None}
    ran_on = ("driver emulator (cuda-emulator kind, --dry-run)" if ctx.dry_run
              else "real GPU (cuda kind)")
    ctx.save(result, ran_on=ran_on)
    # The examples get a share of the time only on a GPU (they need one).
    examples = () if ctx.dry_run else EXAMPLES
    tails, cut = [], []
    for suite in suites:
        limit = ctx.left() - 5 - 40 * len(examples)
        if limit < 10:
            cut.append(suite)
            continue
        _, out, timed_out = _run([sys.executable, "-c", _LAUNCH, *opts, suite], env, limit)
        counts, failures = parse(out)
        for k, v in counts.items():
            result[k] += v
        result["failures"] += failures
        tails.append(f"== {suite}{' (ran past its time)' if timed_out else ''}\n"
                     + out[-(4000 // len(suites)):])
        if timed_out:
            cut.append(suite)
        result["output_tail"] = "\n".join(tails)
        ctx.save(result)
    if result["passed"] + result["failed"] + result["errors"] == 0:
        ctx.save(result, error=f"no test ran on the {kind} kind (does tests/conftest.py see "
                               "the GPU? see output_tail)")
    if cut:
        ctx.save(result, reason="out of time in: " + ", ".join(cut)
                 + ": counts are of what finished")
    ctx.save(result)
    for example in examples:
        code, out, timed_out = _run([sys.executable, example], dict(os.environ),
                                    min(40, ctx.left() - 3))
        result["examples"][example] = {
            "status": "timeout" if timed_out else "passed" if code == 0 else "failed",
            "output_tail": out[-1500:]}
        ctx.save(result)
