"""A framework driver in 70 lines: the Runtime's public driver protocol, on the emulated device.

A toy "framework" allocates its own tensors (as PyTorch does) and runs a chain of functions;
the driver tells the Runtime what happens through the protocol every driver uses
(docs/runtime.rst): ``make_room`` before its framework allocates (allocation pressure),
``adopt`` / ``forget`` its memory, ``begin_iteration`` / ``end_iteration``,
``enter_function`` / ``exit_function``. Under a budget of half its memory it gives the same
results as without one and stays within the budget; under a budget smaller than one function
needs it gives the same results too, over the budget, and says so once.

    python examples/runtime_driver.py
"""

import ctypes
import warnings

import numpy as np

import vmalloc
from vmalloc.offload import BudgetWarning, Runtime

MiB = 1 << 20


def train(budget, steps=3, layers=6):
    dev = vmalloc.HostDevice(capacity="64MiB", granularity="2MiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB")
    rt = Runtime(alloc, budget=budget)
    # NumPy over device memory (HostDevice memory is host-addressable while mapped).
    view = lambda ptr: np.ndarray((MiB // 2,), np.float32,  # noqa: E731
                                  buffer=(ctypes.c_char * (2 * MiB)).from_address(ptr))
    # The framework's own tensors (parameters), adopted outside an iteration: persistent.
    def tensor():
        # Allocation pressure: the driver asks the Runtime to evict before its framework
        # allocates, so the tracked bytes stay within the budget.
        rt.make_room(2 * MiB)
        return rt.adopt(alloc.allocate(2 * MiB), 2 * MiB)

    weights = [tensor() for _ in range(layers)]
    for k, w in enumerate(weights):
        rt.enter_function(writes=[w], name="init")
        view(w.ptr)[...] = 1 + k / 10
        rt.exit_function()
    losses = []
    for step in range(steps):
        rt.begin_iteration()
        x = tensor()                                          # an activation: transient
        rt.enter_function(writes=[x], name="input")
        view(x.ptr)[...] = step + 1
        rt.exit_function()
        for w in weights:
            y = tensor()
            ptrs = rt.enter_function(reads=[x, w], writes=[y], name="layer")
            view(ptrs[y])[...] = view(ptrs[x]) * view(ptrs[w]) / 2
            rt.exit_function()
            rt.forget(x)                    # the framework frees x: the Runtime stops tracking
            alloc.deallocate(x.ptr)
            x = y
        rt.enter_function(reads=[x], name="loss")
        losses.append(float(view(x.ptr).sum()))
        rt.exit_function()
        rt.forget(x)
        alloc.deallocate(x.ptr)
        rt.end_iteration()
    return losses, rt


def main():
    ref, rt_ref = train(budget=None)
    peak = rt_ref.stats()["peak_device_bytes"]
    losses, rt = train(budget=peak // 2)
    s = rt.stats()
    print(f"in core: peak {peak // MiB} MiB; under a budget of {s['budget_bytes'] // MiB} MiB: "
          f"peak {s['peak_device_bytes'] // MiB} MiB, same losses: {losses == ref}")
    print(f"  iterations {s['iterations']} (recorded {s['recorded_iterations']}, scheduled "
          f"{s['scheduled_iterations']}), swapped out {s['swapped_out_bytes'] // MiB} MiB")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        small, rt_small = train(budget=5 * MiB)           # a layer needs 6 MiB at once
    print(f"budget 5 MiB: same losses: {small == ref}; said: {said[0].message}")
    assert said[0].category is BudgetWarning and rt_small.stats()["over_budget"] > 0
    ok = losses == ref and small == ref and s["peak_device_bytes"] <= s["budget_bytes"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
