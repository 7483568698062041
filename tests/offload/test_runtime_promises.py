"""The Runtime's promises off the happy path (issue 15): a failure in a function's entry or
exit leaves it usable, memory it does not own is never relocated, ``forget`` works with the
SwapManager, allocation pressure (``make_room``), an unmeetable budget is said, a budget above
the device is clamped, the default budget works without a device, and the driver protocol is
public. Small devices: every test takes well under a second."""

import warnings

import pytest
from hypothesis import given, settings, strategies as st

import vmalloc
from vmalloc import offload, testing
from vmalloc.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from vmalloc.offload import Buffer, BudgetWarning, Runtime, ScheduleError
from vmalloc.offload.runtime import STATS_KEYS

MiB = 1 << 20


def host_runtime(kind="virtual", capacity="32MiB", **kw):
    dev = vmalloc.HostDevice(capacity=capacity, granularity="2MiB")
    alloc = {"virtual": lambda: vmalloc.VirtualAllocator(dev, chunk_size="2MiB"),
             "packed": lambda: vmalloc.VirtualAllocator(dev, placement="packed"),
             "caching": lambda: vmalloc.CachingAllocator(dev)}[kind]()
    return Runtime(alloc, **kw)


def pattern(n, seed):
    return bytes((i * 13 + seed) & 0xFF for i in range(n))


class DictSwap:
    """A swap backend without a device (as PyTorch's poison backend): keys are pointers."""

    def __init__(self):
        self.where, self.host, self.next = {}, {}, 1 << 20

    def allocate(self, n, stream=0):
        self.next += n
        return self.next

    def state(self, key):
        return self.where.get(key, "resident")

    def swap_out(self, ptr, stream=0):
        self.where[ptr] = "swapping_out"
        return ptr

    def swap_in(self, key, stream=0):
        self.where[key] = "swapping_in"
        return key

    def wait(self, key, stream=0):
        self.where[key] = "on_host" if self.where[key] == "swapping_out" else "resident"

    def deallocate(self, key, stream=0):
        self.where.pop(key, None)

    def stats(self):
        return {}


# --- the protocol is public -------------------------------------------------------------------

def test_runtime_and_buffer_are_exported_and_the_protocol_is_complete():
    from vmalloc.offload.runtime import Runtime as R2
    assert offload.Runtime is R2 is Runtime
    assert offload.Buffer is Buffer
    for name in ("begin_iteration", "end_iteration", "invalidate", "restore_all",
                 "enter_function", "exit_function", "function", "add_writes", "allocate",
                 "adopt", "forget", "make_room", "stats"):
        assert callable(getattr(Runtime, name)), name
    rt = host_runtime(budget="8MiB")
    assert (rt.in_iteration, rt.in_function, rt.budget) == (False, False, 8 * MiB)
    assert set(STATS_KEYS) <= set(rt.stats())


def test_begin_end_enter_exit_are_the_context_managers_unrolled():
    rt = host_runtime(budget="8MiB", scheduler="none")
    w = rt.allocate(MiB)
    rt.begin_iteration()
    assert rt.in_iteration
    x = rt.allocate(MiB)
    ptrs = rt.enter_function(reads=[w], writes=[x], name="f")
    assert rt.in_function and ptrs[w] == w.ptr and ptrs[x] == x.ptr
    rt.exit_function()
    rt.end_iteration()
    assert not rt.in_iteration and not rt.in_function
    s = rt.stats()
    assert (s["iterations"], s["recorded_iterations"], s["functions"]) == (1, 1, 1)
    with pytest.raises(InvalidArgumentError, match="no function is running"):
        rt.exit_function()
    with pytest.raises(InvalidArgumentError, match="no iteration is running"):
        rt.end_iteration()


# --- defect 3: one error does not wedge the runtime -------------------------------------------

def test_out_of_memory_on_entry_leaves_the_runtime_usable():
    rt = host_runtime(capacity="8MiB")            # budget: 8 MiB less 5 %
    a, b = rt.allocate(4 * MiB), rt.allocate(2 * MiB)
    c = rt.allocate(4 * MiB)          # evicts a
    with rt.iteration():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with pytest.raises(OutOfMemoryError):    # 10 MiB at once: the device has 8
                with rt.function(reads=[b, c, a], name="too big"):
                    pass
        with rt.function(reads=[a, b], name="fits") as p:   # was: "functions do not nest"
            assert p[a] == a.ptr
        assert not rt.in_function
    assert [str(w.message) for w in said if w.category is BudgetWarning] == [
        "function 0 (too big) needs 10485760 bytes on the device at once; the budget is "
        "7969177 bytes: it runs over the budget"]
    s = rt.stats()
    assert s["failed_functions"] == 1 and s["over_budget"] == 1
    with rt.iteration():
        with rt.function(reads=[c], name="next"):
            pass
    assert rt.stats()["iterations"] == 2


def test_a_function_over_the_budget_runs_over_it_when_the_device_has_room():
    rt = host_runtime(capacity="32MiB", budget="6MiB")
    a, b = rt.allocate(4 * MiB), rt.allocate(4 * MiB)      # a evicted
    with pytest.warns(BudgetWarning, match=r"function 0 \(both\) needs 8388608 bytes"):
        with rt.iteration():
            with rt.function(reads=[a, b], name="both"):
                assert rt.stats()["device_bytes"] == 8 * MiB
    s = rt.stats()
    assert s["over_budget"] == 1 and s["device_bytes"] <= 6 * MiB   # back under after it
    assert "needs 8388608 bytes" in s["schedule_error"]


def test_a_refused_swap_in_leaves_the_runtime_usable_and_the_data_intact():
    emu = testing.emulator()
    emu.clear_faults()
    dev = testing.emulated_cuda_device(capacity="16MiB", granularity="2MiB")
    alloc = vmalloc.VirtualAllocator(dev)
    rt = Runtime(alloc, budget="4MiB")
    try:
        a = rt.allocate(2 * MiB)
        dev.write(a.ptr, pattern(2 * MiB, 1))
        b = rt.allocate(2 * MiB)
        c = rt.allocate(2 * MiB)      # a goes to the host
        assert a.state == "on_host"
        emu.set_fault("cuMemcpyHtoDAsync", 1, testing.failure_code("cuMemcpyHtoDAsync"))
        try:
            with pytest.raises(vmalloc.DeviceError, match="cuMemcpyHtoDAsync"):
                with rt.function(reads=[a], name="read a"):
                    pass
        finally:
            emu.clear_faults()
        with rt.function(reads=[a], name="read a") as p:
            assert dev.read(p[a], 2 * MiB) == pattern(2 * MiB, 1)
        assert not rt.in_function
        for buf in (a, b, c):
            rt.deallocate(buf)
    finally:
        emu.clear_faults()
        del rt
        dev.synchronize()


def test_an_exception_in_a_function_or_its_exit_leaves_the_runtime_usable():
    rt = host_runtime(budget="8MiB")
    w = rt.allocate(MiB)
    for _ in range(2):                      # record, then follow the schedule
        with rt.iteration():
            x = rt.allocate(MiB)
            with rt.function(reads=[w], writes=[x], name="f"):
                pass
            rt.deallocate(x)
    assert rt.schedule is not None
    with pytest.raises(ZeroDivisionError):
        with rt.iteration():
            with rt.function(reads=[w], name="f"):
                1 / 0

    def boom():
        raise KeyError("driver bookkeeping failed")
    with rt.iteration():
        rt.at_boundary = boom
        with pytest.raises(KeyError):
            with rt.function(reads=[w], name="g"):
                pass
        rt.at_boundary = None
        with rt.function(reads=[w], name="g"):
            pass
    assert not rt.in_iteration and not rt.in_function
    s = rt.stats()
    assert s["failed_functions"] == 2 and s["iterations"] == 4
    with rt.iteration():                    # recorded anew, then a schedule again
        x = rt.allocate(MiB)
        with rt.function(reads=[w], writes=[x], name="f"):
            pass
        rt.deallocate(x)
    assert rt.schedule is not None


# --- defect 1: memory the runtime does not own is never relocated -------------------------------

@pytest.mark.parametrize("kind,nbytes", [("caching", 2 * MiB), ("packed", 2 * MiB),
                                         ("virtual", 64 << 10)])
def test_adopted_memory_on_a_relocating_placement_stays_resident(kind, nbytes):
    rt = host_runtime(kind, capacity="32MiB", budget="6MiB")
    ptr = rt.allocator.allocate(nbytes)          # the framework's own allocation
    rt.device.write(ptr, pattern(nbytes, 5))
    buf = rt.adopt(ptr, nbytes)
    others = [rt.allocate(2 * MiB) for _ in range(4)]   # pressure: evictions
    assert rt.stats()["evictions"] > 0
    assert buf.state == "resident" and rt.device.read(ptr, nbytes) == pattern(nbytes, 5)
    assert rt.make_room(4 * MiB) is True         # everything else goes
    assert rt.stats()["device_bytes"] == buf.footprint
    assert buf.state == "resident" and buf.ptr == ptr
    assert rt.device.read(ptr, nbytes) == pattern(nbytes, 5)
    assert buf.movable is False
    assert rt.stats()["pinned_bytes"] == buf.footprint
    rt.forget(buf)
    rt.allocator.deallocate(ptr)                 # the framework frees its own address
    for b in others:
        rt.deallocate(b)


def test_adopting_memory_the_allocator_does_not_hold_is_refused_and_changes_nothing():
    rt = host_runtime("virtual", budget="4MiB")
    with pytest.raises(InvalidPointerError, match="adopt: 0x40000000 is not a live allocation"):
        rt.adopt(1 << 30, MiB)
    assert rt.buffers() == [] and rt.stats()["device_bytes"] == 0


def test_adopted_whole_chunks_on_the_virtual_allocator_still_swap():
    rt = host_runtime("virtual", budget="4MiB")
    ptr = rt.allocator.allocate(2 * MiB)
    buf = rt.adopt(ptr, 2 * MiB)
    rt.allocate(2 * MiB), rt.allocate(2 * MiB)
    assert buf.state == "on_host" and buf.movable is True


# --- defect 2 (runtime side): forget works with the SwapManager --------------------------------

def test_forget_of_a_swapped_out_buffer_brings_its_bytes_back_to_the_framework():
    rt = host_runtime("virtual", budget="4MiB")
    ptr = rt.allocator.allocate(2 * MiB)
    rt.device.write(ptr, pattern(2 * MiB, 9))
    buf = rt.adopt(ptr, 2 * MiB)
    b1, b2 = rt.allocate(2 * MiB), rt.allocate(2 * MiB)
    assert buf.state == "on_host"
    rt.forget(buf)                               # was: AttributeError ('discard')
    assert buf.state == "freed" and buf not in rt.buffers()
    assert rt.swap.state(ptr) == "resident"
    assert rt.device.read(ptr, 2 * MiB) == pattern(2 * MiB, 9)
    rt.allocator.deallocate(ptr)
    rt.deallocate(b1), rt.deallocate(b2)
    assert rt.stats()["device_bytes"] == 0


# --- defect 5 (runtime side): the budget is a promise -----------------------------------------

def test_make_room_evicts_until_the_bytes_fit_or_nothing_is_left():
    rt = host_runtime(budget="8MiB")
    bufs = [rt.allocate(2 * MiB) for _ in range(4)]
    assert rt.stats()["device_bytes"] == 8 * MiB
    assert rt.make_room(3 * MiB) is True
    assert rt.stats()["device_bytes"] == 4 * MiB      # two evicted (chunk footprints)
    assert [b.state for b in bufs] == ["on_host", "on_host", "resident", "resident"]
    with rt.function(reads=bufs[2:]):
        assert rt.make_room(6 * MiB) is False         # the running function's stay
        assert rt.stats()["device_bytes"] == 4 * MiB
    assert rt.make_room(0) is True
    with pytest.raises(InvalidArgumentError):
        rt.make_room(-1)


def _one_big_function(rt, w=None):
    """A framework's iteration (memory it allocates itself, adopted) whose one function needs
    6 MiB at once."""
    if w is None:
        w = [rt.adopt((1 + i) << 30, 2 * MiB) for i in range(2)]
    with rt.iteration():
        x = rt.adopt(3 << 30, 2 * MiB)
        with rt.function(reads=w, name="big"):
            rt.add_writes([x])
        rt.forget(x)
    return w


def test_an_unmeetable_budget_warns_once_naming_the_function_and_its_bytes():
    rt = Runtime(None, swap=DictSwap(), budget="4MiB")
    with pytest.warns(BudgetWarning, match=r"function 0 \(big\) needs 6291456 bytes"):
        w = _one_big_function(rt)
    msg = rt.stats()["schedule_error"]
    assert "big" in msg and "6291456" in msg and "4194304" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # said once
        for _ in range(2):
            _one_big_function(rt, w)
        rt.invalidate("re-record")                # nor when the program is recorded anew
        _one_big_function(rt, w)
    s = rt.stats()
    assert s["schedule_failures"] == 2 and s["iterations"] == 4
    assert s["peak_device_bytes"] == 6 * MiB     # over the budget: hence the warning


def test_an_unmeetable_budget_raises_under_strict_and_the_runtime_stays_usable():
    rt = Runtime(None, swap=DictSwap(), budget="4MiB", strict=True)
    with pytest.raises(ScheduleError, match=r"function 0 \(big\) needs 6291456 bytes"):
        _one_big_function(rt)
    assert not rt.in_iteration and not rt.in_function
    with rt.function(reads=rt.buffers()[:1]):
        pass


def test_a_schedule_that_fits_says_nothing():
    rt = Runtime(None, swap=DictSwap(), budget="16MiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _one_big_function(rt)
    assert rt.stats()["schedule_error"] is None and rt.schedule is not None


def test_a_budget_above_the_device_is_clamped_with_a_warning():
    with pytest.warns(BudgetWarning, match="exceeds the device's capacity of 33554432"):
        rt = host_runtime(capacity="32MiB", budget="1GiB")
    assert rt.budget == 32 * MiB == rt.stats()["budget_bytes"]


def test_the_default_budget_works_on_a_backend_without_a_device():
    rt = Runtime(None, swap=DictSwap(), host_compute=False)
    assert rt.budget is None
    w = rt.allocate(1 << 40)     # no limit
    for _ in range(3):           # was: "window 4611686018427387904 is larger than ..."
        with rt.iteration():
            x = rt.allocate(MiB)
            with rt.function(reads=[w], writes=[x], name="f"):
                pass
            rt.deallocate(x)
    s = rt.stats()
    assert rt.schedule is not None and s["scheduled_iterations"] == 2
    assert s["evictions"] == 0 and s["schedule_error"] is None


def test_restore_all_brings_everything_back_and_keeps_the_budget():
    rt = host_runtime(budget="4MiB")
    bufs = [rt.allocate(2 * MiB) for _ in range(3)]
    for i, b in enumerate(bufs):
        with rt.function(writes=[b]) as p:
            rt.device.write(p[b], pattern(2 * MiB, i))
    assert bufs[0].state == "on_host"
    rt.restore_all()
    assert all(b.state == "resident" for b in bufs)
    assert [rt.device.read(b.ptr, 2 * MiB) for b in bufs] == [pattern(2 * MiB, i)
                                                              for i in range(3)]
    s = rt.stats()
    assert s["budget_bytes"] == rt.budget == 4 * MiB and s["device_bytes"] == 6 * MiB


def test_invalidate_drops_the_record():
    rt = Runtime(None, swap=DictSwap(), budget="16MiB")
    _one_big_function(rt)
    assert rt.sequence is not None
    rt.invalidate("the driver learned the record is wrong")
    assert rt.sequence is None and rt.schedule is None
    assert rt.last_divergence == "the driver learned the record is wrong"


# --- defect 3, property: any number of refused swaps, and the program still computes the same --

class Refused(Exception):
    """A swap the backend refused (injected before the real call: nothing happened)."""


class RefusingSwap:
    """The SwapManager, refusing the swap-ins and swap-outs whose call numbers are in ``fail``."""

    def __init__(self, manager, fail):
        self._manager, self._fail, self._calls = manager, set(fail), 0

    def _maybe_refuse(self, what):
        self._calls += 1
        if self._calls in self._fail:
            raise Refused(f"{what} call {self._calls} refused")

    def swap_in(self, key, stream=0):
        self._maybe_refuse("swap_in")
        return self._manager.swap_in(key, stream=stream)

    def swap_out(self, ptr, stream=0):
        self._maybe_refuse("swap_out")
        return self._manager.swap_out(ptr, stream=stream)

    def __getattr__(self, name):
        return getattr(self._manager, name)


def _retrying(fn):
    for _ in range(50):
        try:
            return fn()
        except Refused:
            continue
    raise AssertionError("refused 50 times in a row")


def _faulty_program(rt, sizes, steps, iterations):
    """Like test_runtime's random programs, retrying whatever a refused swap failed: an
    allocation, an iteration's start, a function's entry (its body then runs on the retry);
    a function whose exit failed has run."""
    from vmalloc.frameworks import numpy_training as nt

    pers = [_retrying(lambda s=s: rt.allocate(s)) for s in sizes]
    for k, p in enumerate(pers):
        def init(p=p, k=k):
            with rt.function(writes=[p]) as ptrs:
                nt.view(ptrs, p, (p.nbytes // 4,))[...] = k + 1
        _retrying(init)
    sums = []
    for it in range(iterations):
        _retrying(rt.begin_iteration)
        live = list(pers)
        for a, b, kind in steps:
            src = live[a % len(live)]
            if kind == "new":
                dst = _retrying(lambda: rt.allocate(MiB))
                live.append(dst)
            else:
                dst = live[b % len(live)]
            ran = []
            while not ran:
                try:
                    with rt.function(reads=[src], writes=[dst], name=kind) as ptrs:
                        s = nt.view(ptrs, src, (MiB // 4,))
                        d = nt.view(ptrs, dst, (MiB // 4,))
                        d[...] = s * 0.5 + (it + 1)
                        ran.append(float(d.sum()))
                except Refused:
                    pass
            sums.append(ran[0])
        for buf in live[len(pers):]:
            rt.deallocate(buf)
        _retrying(rt.end_iteration)
    return sums


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_refused_swaps_anywhere_leave_the_runtime_usable_and_the_results_exact(data):
    sizes = data.draw(st.lists(st.sampled_from([MiB, 2 * MiB]), min_size=1, max_size=3))
    steps = data.draw(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7),
                                         st.sampled_from(["new", "old"])),
                               min_size=1, max_size=8))
    iterations = data.draw(st.integers(2, 3))
    ref = _faulty_program(host_runtime(capacity="64MiB", scheduler="none"), sizes, steps,
                          iterations)
    fail = data.draw(st.sets(st.integers(1, 60), max_size=8))
    dev = vmalloc.HostDevice(capacity="32MiB", granularity="2MiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB")
    rt = Runtime(alloc, budget="6MiB", swap=RefusingSwap(offload.SwapManager(alloc), fail))
    assert _faulty_program(rt, sizes, steps, iterations) == ref
    assert not rt.in_iteration and not rt.in_function
    assert rt.stats()["peak_device_bytes"] <= 6 * MiB


# --- issue 20, item 5: a BudgetWarning points at the program's line, whatever its path ---------

def test_budget_warnings_point_at_the_programs_line():
    # Fixed stacklevels pointed into vmalloc/offload/runtime (or contextlib) on some paths.
    with pytest.warns(BudgetWarning) as said:
        host_runtime(capacity="8MiB", budget="16MiB")                # clamped to the device
        rt = host_runtime(capacity="32MiB", budget="6MiB")
        a, b = rt.allocate(4 * MiB), rt.allocate(4 * MiB)
        for _ in range(3):                                            # said once
            with rt.iteration():
                with rt.function(reads=[a, b], name="both"):          # over the budget
                    pass
    assert [str(w.message).split(";")[0] for w in said] == [
        "the budget of 16777216 bytes exceeds the device's capacity of 8388608 bytes",
        "function 0 (both) needs 8388608 bytes on the device at once"]
    assert [w.filename for w in said] == [__file__, __file__]
    assert rt.stats()["over_budget"] == 3
