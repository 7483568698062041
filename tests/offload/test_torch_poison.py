"""The poison backend's host copies (vmalloc.frameworks.torch_swap.PoisonSwap): a copy whose
storage came back is reused by the next swap-out of as many bytes, within the most host bytes
the live copies ever held; what poison proves (the storage reads 0xFF while out, its bytes come
back exactly) is unchanged. Work is counted, never timed."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from vmalloc.frameworks.torch_swap import PoisonSwap  # noqa: E402


def _storages(sw, *sizes):
    ts = [torch.arange(n, dtype=torch.float32) + 7 * i for i, n in enumerate(sizes)]
    for t in ts:
        sw.register(t.untyped_storage().data_ptr(), t.untyped_storage())
    return ts, [t.untyped_storage().data_ptr() for t in ts]


def _cycle(sw, ptr, back=True):
    sw.wait(sw.swap_out(ptr))
    if back:
        sw.wait(sw.swap_in(ptr))


def test_a_host_copy_that_came_back_is_reused_by_a_swap_out_of_as_many_bytes():
    sw = PoisonSwap()
    (a, b, c), (pa, pb, pc) = _storages(sw, 1024, 1024, 512)
    want = [t.clone() for t in (a, b, c)]
    _cycle(sw, pa)
    s = sw.stats()
    assert (s["host_copies_reused"], s["host_bytes"], s["host_bytes_kept"]) == (0, 0, 4096)
    _cycle(sw, pb, back=False)           # the same 4096 bytes: A's copy
    assert bool(torch.isnan(b).all())    # poisoned while out, as before
    s = sw.stats()
    assert (s["host_copies_reused"], s["host_bytes"], s["host_bytes_kept"]) == (1, 4096, 0)
    _cycle(sw, pc)                       # 2048 bytes: none kept of that size, a new copy
    s = sw.stats()
    # (6144 bytes were live with B's and C's copies: C's is kept)
    assert (s["host_copies_reused"], s["host_bytes"], s["host_bytes_kept"]) == (1, 4096, 2048)
    sw.wait(sw.swap_in(pb))
    assert all(torch.equal(x, y) for x, y in zip((a, b, c), want))
    assert sw.stats()["host_bytes_kept"] == 6144


def test_a_discarded_copy_is_kept_too():
    sw = PoisonSwap()
    (a, b), (pa, pb) = _storages(sw, 256, 256)
    want = b.clone()
    _cycle(sw, pa, back=False)
    sw.discard(pa)
    assert (sw.stats()["host_bytes"], sw.stats()["host_bytes_kept"]) == (0, 1024)
    _cycle(sw, pb)
    assert sw.stats()["host_copies_reused"] == 1 and torch.equal(b, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=40))
def test_kept_and_live_copies_never_pass_the_most_ever_live_and_bytes_survive(ops):
    sw = PoisonSwap()
    ts, ptrs = _storages(sw, 64, 64, 128, 128, 256, 64)
    want = [t.clone() for t in ts]
    peak = 0
    for i, swap in ops:
        if swap and sw.state(ptrs[i]) == "resident":
            sw.wait(sw.swap_out(ptrs[i]))
            assert bool(torch.isnan(ts[i]).all())
        elif sw.state(ptrs[i]) == "on_host":
            sw.wait(sw.swap_in(ptrs[i]))
        s = sw.stats()
        peak = max(peak, s["host_bytes"])
        assert s["host_bytes"] + s["host_bytes_kept"] <= peak
    for p in ptrs:
        if sw.state(p) == "on_host":
            sw.wait(sw.swap_in(p))
    assert all(torch.equal(x, y) for x, y in zip(ts, want))


def test_a_dispatch_mode_sees_none_of_the_backends_copies():
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    sw = PoisonSwap()
    (a, b), (pa, pb) = _storages(sw, 256, 256)
    _cycle(sw, pa)
    with Count():
        _cycle(sw, pb)          # (a reused copy: copy_, fill_, copy_ back)
    assert seen == [] and sw.stats()["host_copies_reused"] == 1
