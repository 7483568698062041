"""One rank of tests/offload/test_torch_fsdp2.py (run as a script: python fsdp2_worker.py RANK
PORT OUT_DIR STEPS BUDGET): trains the same FSDP2 (fully_shard) job without vmalloc and inside
vmalloc.torch.out_of_core, and saves both results, and the warnings the second gave, to
OUT_DIR/rank<RANK>.pt."""

import sys
import warnings

import torch

import _dist


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
    data = _dist.rank_data(rank, steps, 64)

    def weights():
        return [p.full_tensor() for p in model.parameters()]   # (a collective: both ranks)

    if budget is None:
        return _dist.train(model, opt, data), weights(), None
    with vtorch.out_of_core(backend="poison", device="cpu", budget=budget,
                            min_bytes=4096) as ooc:
        losses = _dist.train(model, opt, data)
    return losses, weights(), ooc.stats()


def main(rank, port, out_dir, steps, budget):
    with _dist.gloo_group(rank, port):
        ref = _job(rank, steps, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _job(rank, steps, budget)
        said = [f"{w.category.__name__}: {w.message}" for w in caught
                if "vmalloc" in w.category.__module__ or "budget" in str(w.message)
                or "out_of_core" in str(w.message)]
        _dist.save(out_dir, rank, ref=ref, got=got, said=said)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
