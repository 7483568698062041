"""One rank of tests/offload/test_torch_distributed.py (run as a script: python
ddp_worker.py RANK PORT OUT_DIR STEPS): trains the same DDP job without vmalloc and inside
vmalloc.torch.out_of_core, and saves both results to OUT_DIR/rank<RANK>.pt."""

import os
import sys

import torch
import torch.distributed as dist

STEPS = 6


def _job(rank, budget):
    import vmalloc.torch as vtorch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)     # each rank its own data
    data = [(torch.randn(128, 128, generator=g), torch.randint(0, 10, (128,), generator=g))
            for _ in range(STEPS)]

    def loop():
        losses = []
        for x, y in data:
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    if budget is None:
        return loop(), [p.detach().clone() for p in model.parameters()], None
    with vtorch.out_of_core(backend="poison", device="cpu", budget=budget) as ooc:
        losses = loop()
    return losses, [p.detach().clone() for p in model.parameters()], ooc.stats()


def main(rank, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ref = _job(rank, None)
        got = _job(rank, "1MiB")
        torch.save({"ref": ref, "got": got}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()




if __name__ == "__main__":
    STEPS = int(sys.argv[4])
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
