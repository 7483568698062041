"""A PyTorch training loop whose CUDA memory comes from vmalloc's VirtualAllocator (needs an
NVIDIA GPU and a CUDA build of PyTorch).

Run: python examples/gpu/torch_train_step.py
"""

import sys


def main():
    try:
        import torch
    except ImportError as error:
        sys.exit(f"torch_train_step.py needs PyTorch (pip install torch): {error}")
    # torch.cuda.is_available() does not initialize CUDA, so the allocator can still be swapped
    if torch.version.cuda is None or not torch.cuda.is_available():
        build = "a CPU-only PyTorch build" if torch.version.cuda is None else "no CUDA device"
        sys.exit(f"torch_train_step.py needs an NVIDIA GPU and a CUDA build of PyTorch: "
                 f"found {build} (torch {torch.__version__})")

    import vmalloc
    import vmalloc.torch

    # Before anything creates a CUDA tensor: PyTorch cannot swap its allocator afterwards.
    allocator = vmalloc.VirtualAllocator(vmalloc.CudaDevice(0), chunk_size="2MiB")
    vmalloc.torch.use_vmalloc(allocator)

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(20):
        x = torch.randn(256, 1024, device="cuda")
        y = torch.randint(0, 10, (256,), device="cuda")
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if step == 4:
            # after warm-up the loop reuses mapped ranges: no more driver calls
            warm = allocator.device.counters()["memory_management_calls"]
    torch.cuda.synchronize()
    vmalloc.torch.check_out_of_memory()  # PyTorch does not check for null pointers itself
    stats = vmalloc.torch.memory_stats()  # torch.cuda.memory_stats() is empty for us
    after = allocator.device.counters()["memory_management_calls"]
    print(f"loss {loss.item():.4f}")
    print(f"peak requested {vmalloc.format_size(stats.peak_requested_bytes)}, "
          f"peak reserved {vmalloc.format_size(stats.peak_reserved_bytes)}, "
          f"utilization {stats.utilization:.1%}")
    print(f"memory-management driver calls after warm-up: {after - warm}")


if __name__ == "__main__":
    main()
