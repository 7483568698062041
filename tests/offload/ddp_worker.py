"""One rank of tests/offload/test_torch_distributed.py (run as a script: python
ddp_worker.py RANK PORT OUT_DIR STEPS): trains the same DDP job without vmalloc and inside
vmalloc.torch.out_of_core, and saves both results to OUT_DIR/rank<RANK>.pt."""

import sys

import torch

import _dist


def _job(rank, steps, budget):
    import vmalloc.torch as vtorch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = _dist.rank_data(rank, steps, 128)

    if budget is None:
        return _dist.train(ddp, opt, data), [p.detach().clone() for p in model.parameters()], None
    with vtorch.out_of_core(backend="poison", device="cpu", budget=budget) as ooc:
        losses = _dist.train(ddp, opt, data)
    return losses, [p.detach().clone() for p in model.parameters()], ooc.stats()


def main(rank, port, out_dir, steps):
    with _dist.gloo_group(rank, port):
        ref = _job(rank, steps, None)
        got = _job(rank, steps, "1MiB")
        _dist.save(out_dir, rank, ref=ref, got=got)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
