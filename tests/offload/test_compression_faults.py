"""Every call of a compressed swap path failing, once and in pairs (issue 20 item 2).

The compressed swaps run on the emulated device (a backed HostDevice: the driver emulator's
devices cannot be cast with NumPy), so faults are injected one level up, in the calls
:class:`CompressingSwap` makes: the device's (``host_alloc``, ``host_free``,
``synchronize_stream``, ``copy_to_host``, ``copy_to_device``), the allocator's
(``map_backing``, ``unmap_backing``), the manager's (``allocate``, ``deallocate``) and the
casts (``to_half_bits``, ``from_half_bits``). As in test_swap_fault_injection.py, the calls of
each operation are counted in a clean run; then for every call site (and every pair of them) a
fresh world repeats the operation with it failing. Each time:

* the operation raises the injected error, or completes,
* no byte is lost: once the faults stop, the buffer comes back and reads its values, or their
  cast round trip (every element of one or the other, never a mix or garbage),
* nothing leaks: once it is freed no pinned host bytes, allocations or mapped bytes remain,
* the backend is usable: the operation then succeeds.

Also the poison backend of the PyTorch driver: its host copy survives a failed restore, and
an error on leaving ``out_of_core`` never hides the block's own error.
"""

import ctypes
import os
import sys

import numpy as np
import pytest

import vmalloc
from vmalloc import allocator_kinds
from vmalloc.offload import SwapManager
from vmalloc.offload.runtime import compressing_swap
from vmalloc.offload.runtime.compression import round_trip

sys.path.insert(0, os.path.dirname(__file__))
from _mlp import mlp_and_step  # noqa: E402  (the MLP the reference-cycle tests train too)

KiB = 1 << 10
MiB = 1 << 20

CALLS = {
    "device": ("host_alloc", "host_free", "synchronize_stream", "copy_to_host",
               "copy_to_device"),
    "allocator": ("map_backing", "unmap_backing"),
    "manager": ("allocate", "deallocate"),
    "cast": ("to_half_bits", "from_half_bits"),
}


class Injected(RuntimeError):
    """The injected failure."""


class Faults:
    """Counts the calls by name and fails the scheduled ones (name, k)."""

    def __init__(self):
        self.counts = {}
        self.fail = set()

    def call(self, name, fn, *args, **kwargs):
        k = self.counts[name] = self.counts.get(name, 0) + 1
        if (name, k) in self.fail:
            raise Injected(f"{name} #{k} failing")
        return fn(*args, **kwargs)


class Proxy:
    def __init__(self, target, names, faults):
        self._target, self._names, self._faults = target, names, faults

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name in self._names:
            return lambda *a, **kw: self._faults.call(name, attr, *a, **kw)
        return attr


def _values(count):
    # every value changes in fp16
    return (np.arange(count, dtype=np.float32) - count / 2) / np.float32(977) + np.float32(1e-4)


VALS = _values(40 * KiB)    # 160 KiB: three 64 KiB chunks of its own
SIZES = {"chunks": 40 * KiB, "small": 250}    # (1000 bytes: a small block, relocated)


class World:
    def __init__(self, kind, monkeypatch, fmt="fp16", count=40 * KiB):
        self.dev = vmalloc.HostDevice(capacity="8MiB", granularity="64KiB")
        # 64 KiB chunks for the virtual kinds (their small blocks: up to half a chunk)
        self.alloc = allocator_kinds.make_allocator(kind, self.dev, chunk_size="64KiB")
        self.sw = compressing_swap.CompressingSwap(SwapManager(self.alloc), self.alloc)
        self.faults = Faults()
        self.sw.device = Proxy(self.dev, CALLS["device"], self.faults)
        self.sw.allocator = Proxy(self.alloc, CALLS["allocator"], self.faults)
        self.sw.manager = Proxy(self.sw.manager, CALLS["manager"], self.faults)
        for name in CALLS["cast"]:
            fn = getattr(compressing_swap, name)
            monkeypatch.setattr(compressing_swap, name,
                                lambda *a, _n=name, _f=fn, **kw: self.faults.call(_n, _f, *a,
                                                                                   **kw))
        self.fmt = fmt
        self.vals = _values(count)
        self.n = self.vals.nbytes
        self.ptr = self.alloc.allocate(self.n)
        self._floats(self.ptr)[...] = self.vals
        self.key = None

    def _floats(self, ptr):
        return np.ctypeslib.as_array((ctypes.c_float * self.vals.size).from_address(ptr))

    def recover(self):
        """Brings the buffer back resident, whatever state a fault left; checks its values."""
        sw = self.sw
        for _ in range(6):
            key = self.key if self.key is not None else self.ptr
            state = sw.state(key)
            if state == "swapping_out":
                sw.wait(key)
            elif state == "on_host":
                self.ptr, self.key = sw.swap_in(key), None
            elif state == "swapping_in":
                sw.wait(key)
            else:
                break
        assert sw.state(self.ptr) == "resident" and self.key is None
        got = self._floats(self.ptr).copy()
        assert (np.array_equal(got, self.vals)
                or np.array_equal(got, round_trip(self.vals, self.fmt))), "bytes lost"

    def teardown(self):
        self.sw.deallocate(self.ptr)
        s = self.sw.stats()
        assert s["compressed_host_bytes"] == 0 and s.get("compressed_orphans", 0) == 0
        assert self.alloc.stats().live_allocations == 0, "allocation leaked"
        del self.sw
        self.alloc.release_cached()
        assert self.dev.state()["host_bytes"] == 0, "pinned host bytes leaked"
        assert self.dev.physical_bytes_in_use == 0, "mapped bytes leaked"


def _out(w):
    w.key = w.sw.swap_out_compressed(w.ptr, w.n, w.fmt)
    w.sw.wait(w.key)


def _in(w):
    w.ptr = w.sw.swap_in(w.key)
    w.key = None
    w.sw.wait(w.ptr)


def _cancel(w):
    w.key = w.sw.swap_out_compressed(w.ptr, w.n, w.fmt)
    w.ptr = w.sw.swap_in(w.key)
    w.key = None
    w.sw.wait(w.ptr)


def _free_on_host(w):
    w.sw.deallocate(w.key)
    w.key = None
    w.ptr = w.alloc.allocate(w.n)    # (the world's buffer again, for the checks)
    w._floats(w.ptr)[...] = w.vals


def _discard_on_host(w):
    c = w.sw._out[w.key]
    stable, old = c.stable, c.ptr
    w.sw.discard(w.key)
    w.key = None
    if stable:
        w.alloc.deallocate(old)      # the owner frees its (unbacked) allocation
    w.ptr = w.alloc.allocate(w.n)
    w._floats(w.ptr)[...] = w.vals


# name -> (warm_up(world), operation(world))
SCENARIOS = {
    "swap_out and wait": (lambda w: None, _out),
    "swap_in and wait": (_out, _in),
    "cancelled swap-out": (lambda w: None, _cancel),
    "free on host": (_out, _free_on_host),
    "discard on host": (_out, _discard_on_host),
}


def _sites(before, after):
    return [(name, k) for name in after for k in range(before.get(name, 0) + 1,
                                                       after[name] + 1)]


def _run(kind, size, monkeypatch, scenario, fail):
    """One world with the sites of ``fail`` failing in the operation; returns the sites the
    operation reached and a failure message or None."""
    warm_up, operation = SCENARIOS[scenario]
    w = World(kind, monkeypatch, count=SIZES[size])
    warm_up(w)
    before = dict(w.faults.counts)
    w.faults.fail = {(n, before.get(n, 0) + k) for n, k in fail}
    try:
        operation(w)
    except Injected:
        pass
    sites = _sites(before, w.faults.counts)
    w.faults.fail = set()
    try:
        w.recover()          # no byte lost
        warm_up(w)
        operation(w)         # usable: the operation now succeeds
        w.recover()
        w.teardown()         # nothing leaked
    except AssertionError as error:
        return sites, f"{scenario}, {kind}, {size}, {fail} failing: {error}"
    except Exception as error:  # noqa: BLE001 - anything else is a bug
        return sites, f"{scenario}, {kind}, {size}, {fail} failing: afterwards " \
                      f"{type(error).__name__}: {error}"
    return sites, None


def _relative(sites, before):
    return [(n, k - before.get(n, 0)) for n, k in sites]


#: The case counts (stated in docs/runtime.rst), per allocator kind: single faults, pairs.
COUNTS = {}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind", allocator_kinds.NAMES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_call_of_a_compressed_swap_failing_once_and_in_pairs(monkeypatch, scenario,
                                                                   kind, size):
    clean, error = _run(kind, size, monkeypatch, scenario, ())
    assert error is None, error
    w = World(kind, monkeypatch, count=SIZES[size])
    SCENARIOS[scenario][0](w)
    base = dict(w.faults.counts)
    singles = [(n, k - base.get(n, 0)) for n, k in clean]
    assert singles
    failures, pairs = [], set()
    for site in singles:
        reached, error = _run(kind, size, monkeypatch, scenario, (site,))
        if error:
            failures.append(error)
        for second in _relative(reached, base):
            if second != site:
                pairs.add(tuple(sorted((site, second))))
    for pair in sorted(pairs):
        _, error = _run(kind, size, monkeypatch, scenario, pair)
        if error:
            failures.append(error)
    COUNTS[(scenario, kind, size)] = (len(singles), len(pairs))
    assert not failures, f"{len(failures)} of {len(singles) + len(pairs)} cases:\n" + \
        "\n".join(failures)


# --- through the Runtime ------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::vmalloc.offload.BudgetWarning")
@pytest.mark.parametrize("fail", [(("copy_to_host", 1),),
                                  (("copy_to_host", 1), ("from_half_bits", 1))],
                         ids=["copy", "copy-and-its-rollback"])
def test_a_failed_compressed_eviction_leaves_the_runtime_usable(monkeypatch, fail):
    """The eviction raises the injected error; the buffer reads its values' round trip (its
    rollback's cast pending if that failed too: the runtime follows the backend) and the next
    eviction succeeds."""
    from vmalloc.offload.runtime import Runtime

    dev = vmalloc.HostDevice(capacity="8MiB", granularity="64KiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="64KiB", small_threshold="32KiB")
    rt = Runtime(alloc, budget=256 * KiB, scheduler="none", compress="fp16")
    faults = Faults()
    rt.swap.device = Proxy(dev, CALLS["device"], faults)
    for name in CALLS["cast"]:
        fn = getattr(compressing_swap, name)
        monkeypatch.setattr(compressing_swap, name,
                            lambda *a, _n=name, _f=fn, **kw: faults.call(_n, _f, *a, **kw))
    with rt.iteration():
        a = rt.allocate(VALS.nbytes, dtype=np.float32, kind="activation")
        with rt.function(writes=[a]) as p:
            np.ctypeslib.as_array((ctypes.c_float * VALS.size).from_address(p[a]))[...] = VALS
        faults.fail = set(fail)
        with pytest.raises(Injected, match="copy_to_host #1"):
            rt.allocate(VALS.nbytes, dtype=np.float32)       # evicts a: fails
        faults.fail = set()
        assert a.state == ("resident" if len(fail) == 1 else "swapping_in")
        b = rt.allocate(VALS.nbytes, dtype=np.float32)       # evicts a: succeeds
        assert a.state == "on_host" and rt.stats()["compressed_swap_outs"] == 1
        rt.deallocate(b)
        with rt.function(reads=[a]) as p:
            got = np.ctypeslib.as_array((ctypes.c_float * VALS.size).from_address(p[a]))
            assert np.array_equal(got, round_trip(round_trip(VALS, "fp16"), "fp16"))
        rt.deallocate(a)
    s = rt.stats()["swap"]
    assert s["compressed_host_bytes"] == 0 and s.get("compressed_orphans", 0) == 0
    assert alloc.stats().live_allocations == 0 and dev.state()["host_bytes"] == 0


# --- the PyTorch poison backend -------------------------------------------------------------
def _failing_byte_copies(monkeypatch, n):
    """The next ``n`` copies into a uint8 tensor (the poison backend's restores) fail."""
    import torch

    plain = torch.Tensor.copy_
    left = [n]

    def copy_(self, src, *args, **kwargs):
        if self.dtype == torch.uint8 and left[0] > 0:
            left[0] -= 1
            raise Injected(f"restoring copy #{n - left[0]} failing")
        return plain(self, src, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return left


def test_poison_backend_keeps_the_host_copy_until_the_restore_succeeded(monkeypatch):
    """Before: swap_in dropped the host copy before the copy that restores it; when that
    copy failed, the bytes were gone."""
    torch = pytest.importorskip("torch")
    from vmalloc.frameworks.torch_swap import PoisonSwap

    sw = PoisonSwap()
    t = torch.arange(1 << 16, dtype=torch.float32)
    s = t.untyped_storage()
    ptr = s.data_ptr()
    sw.register(ptr, s)
    sw.swap_out(ptr)
    sw.wait(ptr)
    assert bool(torch.isnan(t).all())
    _failing_byte_copies(monkeypatch, 1)
    with pytest.raises(Injected):
        sw.swap_in(ptr)
    assert sw.state(ptr) == "on_host" and sw.stats()["host_bytes"] == t.nbytes
    sw.wait(sw.swap_in(ptr))
    assert torch.equal(t, torch.arange(1 << 16, dtype=torch.float32))
    assert sw.state(ptr) == "resident" and sw.stats()["host_bytes"] == 0


@pytest.mark.filterwarnings("ignore::vmalloc.offload.BudgetWarning")
def test_an_error_on_leaving_out_of_core_never_hides_the_block_error(monkeypatch):
    """Before: the failed restore had dropped the host copy, and leaving the block raised a
    KeyError in its place. Now the block's error propagates (the failure on leaving noted on it
    and warned), and the bytes are still on the host: restore_all brings them back."""
    torch = pytest.importorskip("torch")
    import vmalloc.torch as vtorch

    ref, ref_step = mlp_and_step(torch)
    for _ in range(2):
        ref_step()
    model, step = mlp_and_step(torch)
    with pytest.raises(Injected, match="#1") as info, \
            pytest.warns(RuntimeWarning, match="leaving out_of_core after Injected"):
        with vtorch.out_of_core(budget="1MiB", backend="poison", device="cpu") as ooc:
            for _ in range(2):
                step()
            assert ooc.stats()["swapped_out_bytes"] > 0
            _failing_byte_copies(monkeypatch, 1 << 30)   # every restore fails from here
            step()
    assert any("leaving vmalloc.torch.out_of_core also failed" in n
               for n in info.value.__notes__)
    monkeypatch.undo()
    ooc.runtime.restore_all()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)       # no byte lost: the two steps' weights, bit for bit


@pytest.mark.filterwarnings("ignore::vmalloc.offload.BudgetWarning")
def test_poison_backend_a_failed_poison_and_restore_keeps_the_bytes(monkeypatch):
    """Poisoning fails, and so does the restore of the bytes copied aside: the swap-out raises
    the first error, the backend keeps the bytes on the host and the runtime follows it, so
    the buffer's next use brings them back."""
    torch = pytest.importorskip("torch")
    from vmalloc.frameworks.torch_swap import PoisonSwap
    from vmalloc.offload.runtime import Runtime

    sw = PoisonSwap()
    t = torch.arange(1 << 16, dtype=torch.float32)
    s = t.untyped_storage()
    ptr = s.data_ptr()
    sw.register(ptr, s)
    rt = Runtime(None, swap=sw, budget=t.nbytes, scheduler="none")
    rt.begin_iteration()
    b = rt.adopt(ptr, t.nbytes)
    plain_fill = torch.Tensor.fill_

    def fill_(self, value):
        monkeypatch.setattr(torch.Tensor, "fill_", plain_fill)
        with torch.no_grad():
            self[: self.numel() // 2] = 7        # half-poisoned, then the failure
        raise Injected("poisoning failing")
    monkeypatch.setattr(torch.Tensor, "fill_", fill_)
    _failing_byte_copies(monkeypatch, 1)
    with pytest.raises(Injected, match="poisoning failing"):
        rt.make_room(t.nbytes)           # evicts b
    monkeypatch.undo()
    assert sw.state(ptr) == "on_host" and b.state == "on_host"
    assert rt.stats()["device_bytes"] == 0
    with rt.function(reads=[b]):
        assert torch.equal(t, torch.arange(1 << 16, dtype=torch.float32))
    rt.forget(b)
    rt.end_iteration()
    assert sw.stats()["host_bytes"] == 0
