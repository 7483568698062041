"""The runtime and its swap backends leave no reference cycle behind: once the program drops
them they are freed at once (reference counting), not at the next full garbage collection.
Before, every runtime was a cycle (each buffer referred back to it): the device memory and
pinned host memory it held waited for a full collection, and each full collection scanned the
whole heap (PyTorch's objects too, after the PyTorch tests). So was every
``vmalloc.torch.out_of_core`` driver (its helpers referred back to it, and it holds them), with
its runtime, its backend and the backend's host copies.

Each case runs with the garbage collector off: weak references to the main objects must be
dead as soon as the case returns, and a collection then finds nothing the case made (every
object counted, not only vmalloc's, unless a case says why).
"""

import gc
import os
import sys
import warnings
import weakref
from collections import Counter

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _mlp import mlp_and_step  # noqa: E402  (the MLP the fault tests train too)

import vmalloc
from vmalloc import allocator_kinds
from vmalloc.offload import Runtime, ScheduleError, SwapManager
from vmalloc.offload.runtime import compressing_swap
from vmalloc.offload.runtime.compression import round_trip
from vmalloc.offload.runtime.recompute import RecomputeError

KiB = 1 << 10


def left_behind(case):
    """Runs ``case()`` twice (the first time: its imports and caches) with the collector off;
    the second time returns the weak references it gives that are still alive once it returned
    (by name) and the objects a collection then finds, counted by type."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case()
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            refs = case()
            alive = sorted(name for name, ref in refs.items() if ref() is not None)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if enabled:
                gc.enable()
    return alive, found


def weak(**objects):
    return {name: weakref.ref(o) for name, o in objects.items()}


def runtime(capacity="1MiB", budget=512 * KiB, **kw):
    dev = vmalloc.HostDevice(capacity=capacity, granularity="64KiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="64KiB", small_threshold="32KiB")
    return Runtime(alloc, budget=budget, **kw)


def iterations(rt, n=3, size=160 * KiB):
    """x, y (float32 activations) written, then read together: under a budget below their two
    footprints they swap."""
    for _ in range(n):
        with rt.iteration():
            x = rt.allocate(size, dtype="float32", kind="activation")
            with rt.function(writes=[x]):
                pass
            y = rt.allocate(size, dtype="float32", kind="activation")
            with rt.function(writes=[y]):
                pass
            with rt.function(reads=[x, y]):
                pass
            rt.deallocate(x)
            rt.deallocate(y)


def refs_of(rt):
    # (The allocator, device and SwapManager are extension types without weak references:
    # a collection finding nothing says they went with the runtime.)
    return weak(runtime=rt)


# --- the runtime -----------------------------------------------------------------------------

RUNS = {
    # budget, scheduler, options
    "window that swaps": (384 * KiB, "window", {}),
    "no schedule fits (on demand)": (256 * KiB, "window", {}),
    "compressed swaps": (384 * KiB, "window", {"compress": "fp16"}),
    "lms": (2048 * KiB, "lms", {}),
    "vdnn": (256 * KiB, "vdnn", {}),
    "no budget": (None, "window", {}),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_a_runtime_is_freed_as_soon_as_it_is_dropped(run):
    """Before: 67 to 79 objects in cycles per runtime (buffer -> runtime -> its buffers; with
    no schedule fitting, also the ScheduleError kept in ``last_schedule_error`` whose
    traceback's frames hold the runtime)."""
    budget, scheduler, options = RUNS[run]

    def case():
        rt = runtime(capacity="8MiB", budget=budget, scheduler=scheduler, **options)
        iterations(rt)
        rt.stats()
        return refs_of(rt)
    assert left_behind(case) == ([], Counter())


def test_buffers_outliving_their_runtime_do_not_keep_it():
    """A buffer refers to its runtime weakly: ``buffer.runtime`` is the runtime while it lives
    and None after, and no buffer keeps it (its memory is the allocator's)."""
    def case():
        rt = runtime()
        kept = rt.allocate(64 * KiB)
        assert kept.runtime is rt
        refs = refs_of(rt)
        del rt
        assert kept.runtime is None and kept.state == "resident"
        return refs
    assert left_behind(case) == ([], Counter())


def test_a_runtime_left_by_failures_is_freed_as_soon_as_it_is_dropped():
    """A program error inside a function, an allocation the device cannot hold, an error on
    leaving ``with rt`` and a strict ScheduleError: each caught and dropped by the program."""
    def case():
        rt = runtime(capacity="1MiB", budget=512 * KiB)
        with pytest.raises(KeyError):
            with rt.iteration():
                x = rt.allocate(160 * KiB)
                with rt.function(writes=[x]):
                    raise KeyError("the program's own")
        held = []
        with pytest.raises(vmalloc.OutOfMemoryError):
            while True:
                held.append(rt.allocator.allocate(64 * KiB))
        with pytest.raises(vmalloc.VmallocError):
            with rt.iteration():
                rt.allocate(512 * KiB)
        for p in held:
            rt.allocator.deallocate(p)
        with pytest.raises(vmalloc.VmallocError):
            with rt:
                with rt.iteration():
                    rt.allocate(2 << 20)
        strict = runtime(capacity="8MiB", budget=256 * KiB, strict=True)
        with pytest.raises(ScheduleError):
            iterations(strict, n=1, size=192 * KiB)
        return {**refs_of(rt), **{f"strict {k}": r for k, r in refs_of(strict).items()}}
    assert left_behind(case) == ([], Counter())


# --- recompute -----------------------------------------------------------------------------------

class Model:
    """A program object holding its runtime and passing its own methods as reruns (as a
    framework's module would): runtime -> rerun -> model -> runtime, while the runtime keeps
    the rerun."""

    def __init__(self, rt):
        self.rt = rt
        self.fails = 0
        rt.begin_iteration()
        self.x = rt.allocate(160 * KiB)
        rt.call(self.load, writes=[self.x], name="load")
        self.a = rt.allocate(160 * KiB)
        rt.call(self.produce, reads=[self.x], writes=[self.a], name="produce")
        # the schedule's drop of a (variable 0, chain: step 1), as the planner would make it
        rt._buf_of_var[0] = self.a
        rt._rc_chain = {0: [1]}
        rt._drop_for_recompute(0)
        rt.end_iteration(failed=True)
        assert self.a.state == "dropped"

    def load(self, p):
        self.rt.device.write(p[self.x], bytes(range(256)) * 640)

    def produce(self, p):
        if self.fails:
            self.fails -= 1
            raise ValueError("the rerun broke")
        self.rt.device.write(p[self.a], self.rt.device.read(p[self.x], 160 * KiB)[::-1])


def test_reruns_are_not_kept_past_their_iteration():
    """Before: the runtime kept every rerun of its last iteration (``_iter_reruns``) after the
    iteration ended, so a program object passing its methods was in a cycle with it."""
    def case():
        m = Model(runtime(recompute=True, scheduler="none"))
        m.rt.restore_all()                   # a recomputed: its chain (the rerun) let go
        assert m.a.state == "resident" and m.rt.stats()["recomputed_functions"] == 1
        return {**refs_of(m.rt), "model": weakref.ref(m)}
    assert left_behind(case) == ([], Counter())


def test_a_failed_recompute_leaves_no_cycle():
    """Before: ``restore_all`` raised the first RecomputeError from a local of its own frame,
    which that exception's traceback holds: exception -> traceback -> frame -> exception."""
    def case():
        m = Model(runtime(recompute=True, scheduler="none"))
        m.fails = 1
        try:
            m.rt.restore_all()
        except RecomputeError:
            pass
        assert m.a.state == "dropped"
        m.rt.restore_all()
        return {**refs_of(m.rt), "model": weakref.ref(m)}
    assert left_behind(case) == ([], Counter())


def test_an_exception_a_test_keeps_holds_the_runtime_until_it_is_dropped():
    """``pytest.raises(...) as info`` keeps the exception, whose traceback holds the frames
    (and the runtime) it went through and the test's own frame, which holds ``info``: a cycle
    the test makes. Dropping ``info`` ends it; the runtime is then freed at once."""
    def case():
        m = Model(runtime(recompute=True, scheduler="none"))
        m.fails = 1
        with pytest.raises(RecomputeError) as info:
            m.rt.restore_all()
        m.rt.restore_all()       # (a recomputed: its chain, which holds m, let go)
        refs = {**refs_of(m.rt), "model": weakref.ref(m)}
        del m
        assert refs["runtime"]() is not None      # the traceback's frames hold it
        del info
        return refs
    assert left_behind(case) == ([], Counter())



def test_a_failed_rollback_of_a_failed_recompute_leaves_no_cycle():
    """The rerun raises and releasing the memory mapped for it fails too (the driver
    emulator's cuMemUnmap). Before: ``_recompute_now`` kept that second error in a local
    while raising, and its traceback holds that frame: a cycle with the runtime."""
    from vmalloc import testing

    emu = testing.emulator()

    def case():
        dev = testing.emulated_cuda_device(capacity="4MiB", granularity="64KiB")
        alloc = allocator_kinds.make_allocator("virtual", dev, chunk_size="64KiB")
        m = Model(Runtime(alloc, recompute=True, scheduler="none"))
        m.fails = 1
        emu.set_fault("cuMemUnmap", 1, testing.failure_code("cuMemUnmap"))
        try:
            m.rt.restore_all()
        except RecomputeError as error:
            raised = str(error)
        finally:
            emu.clear_faults()
        assert "releasing the memory mapped for it failed too" in raised
        m.rt.restore_all()
        assert m.a.state == "resident"
        return {**refs_of(m.rt), "model": weakref.ref(m)}
    assert left_behind(case) == ([], Counter())

# --- the compressed swaps' backend ---------------------------------------------------------------

def test_compressed_swaps_make_no_class_per_size():
    """Before: every cast viewed the allocation as a ctypes array, ``c_float * count``: a class
    per size, each class a cycle of 7 objects (14 per swap out and in)."""
    def case():
        dev = vmalloc.HostDevice(capacity="8MiB", granularity="64KiB")
        alloc = allocator_kinds.make_allocator("virtual", dev, chunk_size="64KiB")
        sw = compressing_swap.CompressingSwap(SwapManager(alloc), alloc)
        vals = np.arange(40 * KiB, dtype=np.float32) / np.float32(977)
        ptr = alloc.allocate(vals.nbytes)
        dev.write(ptr, vals.tobytes())
        key = sw.swap_out_compressed(ptr, vals.nbytes, "fp16")
        sw.wait(key)
        ptr = sw.swap_in(key)
        sw.wait(ptr)
        got = np.frombuffer(dev.read(ptr, vals.nbytes), np.float32)
        assert np.array_equal(got, round_trip(vals, "fp16"))
        sw.deallocate(ptr)
        return weak(swap=sw)
    assert left_behind(case) == ([], Counter())


# --- the PyTorch driver --------------------------------------------------------------------------

def _mlp(torch):
    return mlp_and_step(torch)[1]


def _transformer(torch):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1))

    def step():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return out
    return step


def _driver_refs(ooc):
    return weak(driver=ooc, runtime=ooc.runtime, backend=ooc.backend, steady=ooc._steady,
                pressure=ooc._steady.pressure, storages=ooc._storages)


#: Objects PyTorch 2.13's own pytree functions leave in cycles (``tree_flatten`` makes a
#: recursive closure per call; ``tree_map`` calls it): not the driver's, and never a tensor.
TORCH_PYTREE = {"builtins.tuple", "builtins.cell", "builtins.function", "types.GenericAlias"}

# name -> (model, budget, steps, the stats the run must show: it took that path)
DRIVER_RUNS = {
    "steady, no budget": (_mlp, None, 4, {"steady_iterations": 1}),
    "swapping on the dispatch path": (_mlp, "1MiB", 4, {"steady_iterations": 0}),
    "steady under pressure": (_transformer, 1802240 // 2, 7, {"pressure_iterations": 3}),
}


@pytest.mark.parametrize("run", list(DRIVER_RUNS))
def test_an_out_of_core_driver_is_freed_as_soon_as_it_is_dropped(run):
    """Before: the driver's helpers (storages, readers, steady state, pressure, its dispatch
    mode) each held it, and the pressure replay's weak-reference callbacks held the replay:
    1090 objects in cycles (the runtime, the backend and its host copies among them) after 6
    steps swapping; 479 without a budget. A collection now finds none of vmalloc's objects and
    no tensor; without a budget (no op predicted on the meta device) nothing at all."""
    torch = pytest.importorskip("torch")
    import vmalloc.torch as vtorch
    model, budget, steps, shown = DRIVER_RUNS[run]
    stats, models = {}, []

    def case():
        step = model(torch)
        models.append(step)        # the model outlives the block (its storages too)
        with vtorch.out_of_core(budget=budget, backend="poison", device="cpu") as ooc:
            for _ in range(steps):
                models.append(step())      # and its last output
        stats.update(ooc.stats())
        return _driver_refs(ooc)
    alive, found = left_behind(case)
    assert {k: stats[k] for k in shown} == shown
    assert alive == []
    assert not set(found) - TORCH_PYTREE, found
    if budget is None:
        assert found == Counter()


def _failing_restores(torch):
    """``Tensor.copy_`` that fails for byte views (the poison backend's restores) only."""
    plain = torch.Tensor.copy_

    def failing(self, src, *args, **kwargs):
        if self.dtype == torch.uint8:
            raise RuntimeError("restore failing")
        return plain(self, src, *args, **kwargs)
    return failing


def test_an_out_of_core_driver_left_by_an_error_is_freed_as_soon_as_it_is_dropped(monkeypatch):
    """Every restore fails from the third step on: the block's error propagates (caught and
    dropped here), the bytes stay on the host, ``restore_all`` brings them back once the fault
    is gone; then nothing keeps the driver."""
    torch = pytest.importorskip("torch")
    import vmalloc.torch as vtorch
    failing = _failing_restores(torch)

    def case():
        step = _mlp(torch)
        try:
            with vtorch.out_of_core(budget="1MiB", backend="poison", device="cpu") as ooc:
                for _ in range(2):
                    step()
                monkeypatch.setattr(torch.Tensor, "copy_", failing)
                step()
        except RuntimeError:
            pass
        monkeypatch.undo()
        assert ooc.stats()["swap"]["host_bytes"] > 0
        ooc.runtime.restore_all()
        return _driver_refs(ooc)
    alive, found = left_behind(case)
    assert alive == []
    assert not set(found) - TORCH_PYTREE, found


def test_an_out_of_core_driver_whose_exit_failed_is_freed_as_soon_as_it_is_dropped(
        monkeypatch):
    """The block ends normally but bringing the storages back fails: that error is raised on
    leaving (caught and dropped here). Before: ``leaving`` raised it from a local of its own
    frame, which its traceback holds, with the driver's steps: a cycle with the driver."""
    torch = pytest.importorskip("torch")
    import vmalloc.torch as vtorch
    failing = _failing_restores(torch)

    def case():
        step = _mlp(torch)
        try:
            with vtorch.out_of_core(budget="1MiB", backend="poison", device="cpu") as ooc:
                for _ in range(2):
                    step()
                monkeypatch.setattr(torch.Tensor, "copy_", failing)
        except RuntimeError as error:
            raised = str(error)
        monkeypatch.undo()
        assert raised == "restore failing"
        ooc.runtime.restore_all()
        assert ooc.stats()["swap"]["host_bytes"] == 0
        return _driver_refs(ooc)
    alive, found = left_behind(case)
    assert alive == []
    assert not set(found) - TORCH_PYTREE, found


def test_recording_a_model_keeps_none_of_its_storages():
    """Before: the recorder made its dispatch mode's class per recording; a class is a cycle,
    and its method's closure held the trace, with every storage it saw (20 storages here,
    the model's weights among them) until a full collection."""
    torch = pytest.importorskip("torch")
    from vmalloc.offload.sequence.recorder import record

    def case():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
        seq = record(model, torch.randn(8, 64))
        assert len(seq.functions) == 23
        return weak(sequence=seq)
    alive, found = left_behind(case)
    assert alive == []
    assert not set(found) - TORCH_PYTREE, found
