"""PyTorch out-of-core training on CPU, no GPU needed: an unmodified training loop inside
``vmalloc.torch.out_of_core`` with the poison backend trains bit-identically under a budget,
a budget no schedule meets is said once (a warning) or refused (``strict=True``), and an op
whose own storages do not fit the budget runs over it, said once (a warning), or under
``strict=True`` is refused with out of memory.

    python examples/torch_out_of_core_cpu.py

The poison backend swaps a CPU storage out by copying its bytes aside and overwriting it with
0xFF bytes (NaN): an op that read a swapped-out storage would change the losses.
"""

import warnings

import torch

import vmalloc.torch
from vmalloc.offload.scheduling.schedule import ScheduleError


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, opt, data):
    losses = []
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()            # an optimizer's step() ends an iteration
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(128, 128, generator=g), torch.randint(0, 10, (128,), generator=g))
            for _ in range(5)]
    reference = train(*make(), data)

    # 1 MiB for storages of 64 KiB and more (parameters, momentum, activations, gradients).
    model, opt = make()
    with vmalloc.torch.out_of_core(budget="1MiB", backend="poison", device="cpu") as ooc:
        losses = train(model, opt, data)
    stats = ooc.stats()
    assert losses == reference, "the schedule let an op read a swapped-out storage"
    assert stats["peak_device_bytes"] <= stats["budget_bytes"] == 1 << 20
    print(f"bit-identical under a 1 MiB budget: {stats['scheduled_iterations']} of "
          f"{stats['iterations']} iterations followed the schedule, "
          f"{stats['swapped_out_bytes'] >> 10} KiB swapped out, peak "
          f"{stats['peak_device_bytes'] >> 10} KiB")

    # A scheduler that cannot meet the budget ("none" keeps everything resident): said once
    # (a warning naming the function and the bytes it needs, with stats); the iterations run
    # on demand, still within the budget and still bit-identical.
    model, opt = make()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with vmalloc.torch.out_of_core(budget="1MiB", scheduler="none", backend="poison",
                                       device="cpu") as ooc:
            losses = train(model, opt, data)
    assert losses == reference and len(said) == 1
    print("said once:", said[0].message)
    print(f"  schedule_failures={ooc.stats()['schedule_failures']}, "
          f"peak {ooc.stats()['peak_device_bytes'] >> 10} KiB")

    # strict=True: the same budget raises instead (the block leaves everything resident).
    model, opt = make()
    try:
        with vmalloc.torch.out_of_core(budget="1MiB", scheduler="none", backend="poison",
                                       device="cpu", strict=True):
            train(model, opt, data)
    except ScheduleError as error:
        print("strict=True raised", type(error).__name__)
    else:
        raise AssertionError("strict=True did not raise")

    # A budget below what one op needs at once (its inputs and outputs): the op runs over the
    # budget (here the CPU has the room; on a full GPU the allocator raises out of memory),
    # said once, and counted in stats(); still bit-identical.
    model, opt = make()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with vmalloc.torch.out_of_core(budget="200KiB", backend="poison", device="cpu") as ooc:
            losses = train(model, opt, data)
    stats = ooc.stats()
    assert losses == reference and len(said) == 1
    assert stats["over_budget_ops"] > 0 and stats["peak_device_bytes"] > stats["budget_bytes"]
    print("200 KiB, said once:", said[0].message)
    print(f"  over_budget_ops={stats['over_budget_ops']}, peak "
          f"{stats['peak_device_bytes'] >> 10} KiB")

    # strict=True refuses such an op before it runs: out of memory, as on a GPU. The runtime
    # stays usable: catch it and go on with a larger budget or a smaller batch.
    model, opt = make()
    try:
        with vmalloc.torch.out_of_core(budget="200KiB", backend="poison", device="cpu",
                                       strict=True):
            train(model, opt, data)
    except MemoryError as error:      # vmalloc.errors.OutOfMemoryError
        print("200 KiB, strict=True:", error)
    else:
        raise AssertionError("strict=True did not refuse the op")


if __name__ == "__main__":
    main()
