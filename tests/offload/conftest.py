"""The parent side of the two-rank gloo tests (test_torch_distributed.py,
test_torch_fsdp2.py); the child side is _dist.py."""

import os
import socket
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run_two_ranks(tmp_path):
    """``run_two_ranks(worker, *args, timeout=...)``: runs ``python WORKER RANK PORT TMP_PATH
    ARGS...`` (WORKER a script of this folder) as ranks 0 and 1 on a free localhost port,
    asserts both exit 0, and returns each rank's results (``rank<RANK>.pt``, loaded)."""
    import torch

    import vmalloc

    def run(worker, *args, timeout):
        env = dict(os.environ)
        # The children import the vmalloc this test imports (a build tree, or the installed one).
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.dirname(vmalloc.__file__))] +
            [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, os.path.join(_HERE, worker), str(rank),
                                   str(port), str(tmp_path)] + [str(a) for a in args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank in range(2)]
        outputs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
        # (a rank that fails makes the other's collective fail: show both)
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
        return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
                for rank in range(2)]

    return run
