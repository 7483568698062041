"""vmalloc.cupy's out-of-core helpers: the runtime over a vmalloc allocator and CuPy arrays
over its buffers. CuPy imports without a GPU; its kernels do not run here, so these tests
check what is built (pointers, shapes, errors), and the runtime's logic is tested with NumPy
in test_runtime.py."""

import pytest

cupy = pytest.importorskip("cupy")

import vmalloc  # noqa: E402
import vmalloc.cupy as vcupy  # noqa: E402
from vmalloc.errors import InvalidArgumentError, VmallocError  # noqa: E402

MiB = 1 << 20


def make_runtime(**kw):
    dev = vmalloc.HostDevice(capacity="64MiB", granularity="2MiB")
    return vcupy.out_of_core(vmalloc.VirtualAllocator(dev), stream=0, **kw)


def test_arrays_view_the_buffers_of_a_function():
    rt = make_runtime(budget="16MiB")
    w = rt.allocate(4 * MiB)
    with rt.iteration():
        x = rt.allocate(2 * MiB)
        with rt.function(reads=[w], writes=[x], name="f") as p:
            a = vcupy.array(p, w, (1024, 1024), "float32")
            b = vcupy.array(p, x, (512, 1024))
            assert a.data.ptr == p[w] == w.ptr
            assert b.data.ptr == p[x]
            assert a.shape == (1024, 1024) and a.dtype == cupy.float32
            assert b.nbytes == 2 * MiB
    assert rt.stream == 0
    assert rt.host_compute is False


def test_an_array_larger_than_its_buffer_is_refused():
    rt = make_runtime()
    w = rt.allocate(MiB)
    with rt.function(reads=[w]) as p:
        with pytest.raises(InvalidArgumentError, match=r"needs 4194304 bytes; buffer \d+ has 1048576"):
            vcupy.array(p, w, (1024, 1024), "float32")


def test_no_current_allocator_is_a_clear_error():
    with pytest.raises(VmallocError, match="no current vmalloc allocator"):
        vcupy.out_of_core(device=7, stream=0)


def test_out_of_core_has_the_shape_of_every_driver():
    """A context manager with stats() (the common keys, kept after the block), the shared
    defaults, and every buffer back on the device when it ends."""
    from vmalloc.offload.runtime import STATS_KEYS

    assert make_runtime(recompute=True).recompute is True
    with make_runtime(budget="4MiB") as rt:
        assert (rt.persistent, rt.window, rt.recompute) == ("auto", None, False)
        bufs = [rt.allocate(2 * MiB) for _ in range(3)]
        assert bufs[0].state == "on_host"
    assert [b.state for b in bufs] == ["resident"] * 3
    stats = rt.stats()
    assert set(STATS_KEYS) <= set(stats)
    assert stats["budget_bytes"] == 4 * MiB and stats["evictions"] == 1


def test_the_documented_import_path_is_the_driver():
    import vmalloc.frameworks.cupy as driver
    assert vcupy is driver
    from vmalloc.cupy import VmallocCupyAllocator, use_vmalloc  # noqa: F401
