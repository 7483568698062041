"""vmalloc.torch.out_of_core under torch.distributed: DistributedDataParallel over gloo, two
processes on this machine (localhost only), on CPU with the poison backend.

Each rank trains the same job twice, without vmalloc and inside out_of_core under a budget:
losses and weights must be bit-identical (gloo's sum of two ranks is deterministic), and from
the third iteration on every iteration must follow the schedule with swaps (DDP's gradient
buckets are persistent: a collective touched them).
"""

import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

STEPS = 6
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_worker.py")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_ddp_two_processes_bit_identical_and_following_the_schedule(tmp_path):
    import vmalloc

    env = dict(os.environ)
    # The children import the vmalloc this test imports (a build tree, or the installed one).
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(vmalloc.__file__))] +
        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(port), str(tmp_path),
                               str(STEPS)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in range(2)]
    outputs = [p.communicate(timeout=220)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        (ref_losses, ref_w, _), (losses, w, stats) = result["ref"], result["got"]
        assert losses == ref_losses, rank
        assert all(torch.equal(a, b) for a, b in zip(w, ref_w)), rank
        assert stats["iterations"] == STEPS
        # iteration 1 recorded, 2 recorded again (new optimizer; DDP's buckets persistent,
        # DDP rebuilds them), then every iteration follows the schedule
        assert stats["scheduled_iterations"] >= STEPS - 3, stats
        assert stats["diverged_iterations"] == 0, stats
        assert stats["scheduled_swap_outs"] > 0 and stats["scheduled_swap_ins"] > 0, stats
        assert stats["peak_device_bytes"] <= 1 << 20, stats
