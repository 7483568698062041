"""vmalloc.torch.out_of_core and storages changed outside the dispatcher (issue 21 item 3):
``UntypedStorage.resize_`` (FSDP2 frees and reallocates parameters with it) of a swapped-out
storage keeps its bytes, and storages allocated outside the dispatcher that break the budget
are said. The poison backend: a storage read while swapped out reads 0xFF bytes.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.offload.runtime import BudgetWarning  # noqa: E402

N = 64 << 10       # floats: 256 KiB per tensor


def test_resize_of_a_swapped_out_storage_keeps_its_bytes():
    """Before: the runtime kept the old buffer at the old address; the grown storage moved,
    and swapping it in failed with a size mismatch (or restored into another storage)."""
    a = torch.arange(N, dtype=torch.float32)
    with vtorch.out_of_core(backend="poison", device="cpu", budget=600_000,
                            min_bytes=4096) as ooc:
        with ooc.step():
            a.add_(1)                       # a tracked, resident
            b = torch.ones(N) * 2           # b and c push a out
            c = b * 3
            assert ooc.runtime.stats()["evictions"] >= 1
        a.untyped_storage().resize_(2 * N * 4)      # grows: a's bytes must come back first
        with ooc.step():
            d = a[:N].sum()     # reads a: swapped in whole
    expected = torch.arange(N, dtype=torch.float32) + 1
    assert d.item() == expected.sum().item() and torch.equal(a[:N], expected)
    assert torch.equal(c, torch.full((N,), 6.0))


def test_resize_to_zero_of_a_swapped_out_storage_brings_nothing_back():
    a = torch.arange(N, dtype=torch.float32)
    with vtorch.out_of_core(backend="poison", device="cpu", budget=600_000,
                            min_bytes=4096) as ooc:
        with ooc.step():
            a.add_(1)
            b = torch.ones(N) * 2
            c = b * 3
        swapped_in = ooc.runtime.stats()["swapped_in_bytes"]
        a.untyped_storage().resize_(0)      # freed (FSDP2's reshard): its copy is dropped
        assert ooc.runtime.stats()["swapped_in_bytes"] == swapped_in
        stats = ooc.stats()
    assert a.untyped_storage().nbytes() == 0 and torch.equal(c, torch.full((N,), 6.0))
    assert stats["peak_device_bytes"] <= 600_000


def test_storages_allocated_outside_the_dispatcher_that_break_the_budget_are_said():
    """Before: an op on a 1 MiB tensor made before the block, under a 512 KiB budget, ran
    with over_budget_ops 0 and no warning, its peak over the budget."""
    big = torch.ones(4 * N)     # 1 MiB, before the block: the driver never saw it made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtorch.out_of_core(backend="poison", device="cpu", budget=512 << 10,
                                min_bytes=4096) as ooc:
            with ooc.step():
                total = big.sum().item()
    said = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    stats = ooc.stats()
    assert total == 4 * N
    assert stats["peak_device_bytes"] == 1 << 20
    assert stats["over_budget_ops"] == 1, stats
    assert said == ["aten.sum.default uses 1048576 bytes of storages allocated "
                    "outside the dispatcher (before the block, or by resize_), more than the "
                    "budget of 524288 bytes leaves: it runs over the budget"], said
