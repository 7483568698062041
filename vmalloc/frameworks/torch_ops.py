"""Counting the aten ops a call runs: what the benchmarks and gpu-check divide the time an
out-of-core step adds by ("us added per aten op")."""


def count_aten_ops(fn, *args, **kwargs) -> int:
    """The aten ops ``fn(*args, **kwargs)`` dispatches, counted by a dispatch mode that does
    nothing else (its result is dropped)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn(*args, **kwargs)
    return Count.n
