"""The build step: vmalloc built on the machine with no network, with what it has installed
(CMake, ninja, Cython, scikit-build-core): ``scripts/dev-build gpu-check`` (the default) or
``pip install --no-build-isolation --no-deps .``; or an importable build reused."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV_NAME = "gpu-check"

_CHECK = ("import vmalloc, vmalloc._core.device, os; "
          "print(os.path.dirname(os.path.dirname(vmalloc.__file__)))")


def importable(env=None, cwd=None):
    """The folder vmalloc (with its compiled modules) is imported from in a child with ``env``,
    or None."""
    try:
        proc = subprocess.run([sys.executable, "-c", _CHECK], env=env, cwd=cwd or "/",
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def _run(cmd, limit, env=None):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=limit)
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def run(args, limit, out):
    """-> a payload: ``{"ran_on", "reason", "error", "result"}``."""
    method = args.build
    result = {"method": None, "command": None, "python_path": None, "reused": False,
              "log_tail": None}
    payload = {"ran_on": f"{os.uname().nodename}, {os.cpu_count()} cores, no network needed",
               "reason": None, "error": None, "result": result}
    if method in ("auto", "none"):
        found = importable(cwd=out)
        if found or method == "none":
            result.update(method="existing", reused=True, python_path=found)
            payload["reason"] = (f"reused the vmalloc importable from {found}" if found else
                                 "--build none: nothing importable")
            if not found:
                payload["error"] = "--build none, but vmalloc is not importable"
            return payload
        method = "dev"
    # This interpreter first on PATH: CMake's FindPython (and with it `python -m cython`)
    # then builds for the Python that runs the checks.
    env = dict(os.environ, JOBS=str(os.cpu_count() or 2),
               PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                     os.environ.get("PATH", "")]))
    if method == "dev":
        cmd = ["scripts/dev-build", DEV_NAME]
        python_path = ROOT / "build" / DEV_NAME / "python"
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
               "--no-index", "."]
        python_path = None
    result.update(method=method, command=" ".join(cmd))
    try:
        code, log = _run(cmd, limit, env)
    except subprocess.TimeoutExpired:
        payload["error"] = f"the build ran past its {limit} s limit"
        return payload
    result["log_tail"] = log
    if code != 0:
        payload["error"] = f"{' '.join(cmd)} failed with status {code}"
        return payload
    child_env = dict(os.environ)
    if python_path:
        child_env["PYTHONPATH"] = os.pathsep.join(
            [str(python_path)] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH")
                                  else []))
    found = importable(child_env, cwd=out)
    if not found:
        payload["error"] = "built, but vmalloc does not import from the build"
    result["python_path"] = str(python_path) if python_path else found
    return payload
