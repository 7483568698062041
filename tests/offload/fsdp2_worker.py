"""One rank of tests/offload/test_torch_fsdp2.py (run as a script: python fsdp2_worker.py RANK
PORT OUT_DIR): a tiny model sharded by FSDP2 (fully_shard) trains inside
vmalloc.torch.out_of_core; the worker saves the first error (type, message, notes) and the
warnings about leaving out_of_core."""

import os
import sys
import warnings

import torch
import torch.distributed as dist


def main(rank, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import vmalloc.torch as vtorch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)
    result = {"error": None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with vtorch.out_of_core(backend="poison", device="cpu", budget="256KiB",
                                        min_bytes=4096):
                    for _ in range(3):
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
            except Exception as error:  # noqa: BLE001 - what the program sees first
                result["error"] = (type(error).__name__, str(error),
                                   list(getattr(error, "__notes__", [])))
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                              if "out_of_core" in str(w.message)]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
