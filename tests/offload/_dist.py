"""The child side of the two-rank gloo tests (test_torch_distributed.py, test_torch_fsdp2.py):
what every rank worker (ddp_worker.py, fsdp2_worker.py, run as scripts, so this file is their
sibling import) does around its own job. The parent side is the ``run_two_ranks`` fixture
(tests/offload/conftest.py). ``train`` also serves test_torch_recompute.py."""

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

WORLD_SIZE = 2


@contextmanager
def gloo_group(rank, port):
    """The process group of this rank over gloo on localhost:PORT, destroyed on leaving."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_data(rank, steps, features):
    """STEPS batches of 128 samples of FEATURES inputs and 10 classes, each rank its own."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(128, features, generator=g), torch.randint(0, 10, (128,), generator=g))
            for _ in range(steps)]


def train(forward, opt, data):
    """One pass of SGD steps over DATA; the losses."""
    losses = []
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def save(out_dir, rank, **results):
    """The rank's results, for the parent: OUT_DIR/rank<RANK>.pt."""
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
