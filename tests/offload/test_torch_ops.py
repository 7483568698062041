"""count_aten_ops: the denominator of the benchmarks' and gpu-check's "us added per aten op"."""

import pytest

torch = pytest.importorskip("torch", reason="counting aten ops needs PyTorch")

from vmalloc.frameworks.torch_ops import count_aten_ops  # noqa: E402


def test_counts_each_dispatched_op_exactly():
    a, b = torch.ones(4), torch.ones(4)
    assert count_aten_ops(torch.add, a, b) == 1
    assert count_aten_ops(lambda: a.mul(2).add(1).sum()) == 3
    assert count_aten_ops(lambda: None) == 0


def test_counts_are_per_call_and_leave_no_mode_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    a = torch.ones(3)
    assert [count_aten_ops(a.neg) for _ in range(3)] == [1, 1, 1]
    assert _get_current_dispatch_mode() is None
