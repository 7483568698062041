"""One rank of tests/offload/test_torch_fsdp2.py (run as a script: python fsdp2_worker.py RANK
PORT OUT_DIR STEPS BUDGET): trains the same FSDP2 (fully_shard) job without vmalloc and inside
vmalloc.torch.out_of_core, and saves both results, and the warnings the second gave, to
OUT_DIR/rank<RANK>.pt."""

import os
import sys
import warnings

import torch
import torch.distributed as dist


def _job(rank, steps, budget):
    import vmalloc.torch as vtorch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)     # each rank its own data
    data = [(torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g))
            for _ in range(steps)]

    def loop():
        losses = []
        for x, y in data:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def weights():
        return [p.full_tensor() for p in model.parameters()]   # (a collective: both ranks)

    if budget is None:
        return loop(), weights(), None
    with vtorch.out_of_core(backend="poison", device="cpu", budget=budget,
                            min_bytes=4096) as ooc:
        losses = loop()
    return losses, weights(), ooc.stats()


def main(rank, port, out_dir, steps, budget):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ref = _job(rank, steps, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _job(rank, steps, budget)
        said = [f"{w.category.__name__}: {w.message}" for w in caught
                if "vmalloc" in w.category.__module__ or "budget" in str(w.message)
                or "out_of_core" in str(w.message)]
        torch.save({"ref": ref, "got": got, "said": said},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
