"""vmalloc.torch.out_of_core under FSDP2 (torch.distributed.fsdp.fully_shard), two gloo
processes on this machine (localhost), CPU, the poison backend.

FSDP2 frees and reallocates its unsharded parameters by resizing their storages, outside the
dispatcher: the driver cannot follow it, so it refuses FSDP2 at its first op. The first error
each rank sees names FSDP2 and what to do, and nothing masks it or is said beside it. Before,
the first error was 'The size of tensor a (0) must match ...' from PoisonSwap.swap_in.
"""

import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.fsdp")

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
if not hasattr(__import__("torch.distributed.fsdp").distributed.fsdp, "fully_shard"):
    pytest.skip("this PyTorch has no FSDP2 (fully_shard)", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp2_worker.py")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_fsdp2_is_refused_by_a_first_error_naming_it(tmp_path):
    import vmalloc

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(vmalloc.__file__))] +
        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(2)]
    outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        name, message, notes = result["error"]
        assert name == "InvalidArgumentError", (rank, name, message)
        assert message.startswith("FSDP2 (torch.distributed.fsdp.fully_shard) is not "
                                  "supported inside vmalloc.torch.out_of_core"), message
        assert "fsdp.all_gather_copy_in" in message, message
        assert "Run FSDP2 outside out_of_core, or use DistributedDataParallel" in message
        assert notes == [] and result["warnings"] == [], result   # nothing failed beside it
