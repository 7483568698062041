"""Every wrapper class builds its C++ object in ``__cinit__``: an object made with
``cls.__new__(cls, ...)`` is as complete as one made with ``cls(...)``, or it is not made at all
(a clean exception); the abstract bases cannot be made; a second ``__init__`` is refused and
changes nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc import testing
from vmalloc._core.physical_chunk_pool import PhysicalChunkPool
from vmalloc.replay._replay import Replay
from vmalloc.traces._trace_parse import Kept, Pass
from vmalloc.offload import SwapManager
from vmalloc.traces.events import ALLOC, EVENT_DTYPE, FREE

MiB = 1 << 20

#: Static methods (no instance state; some change process-wide settings).
STATIC = {"vma_limit", "set_vma_limit", "process_vmas", "driver_entry_points", "default_library"}

#: Every wrapper class of a C++ object.
CLASSES = [vmalloc.Device, vmalloc.HostDevice, vmalloc.CudaDevice, vmalloc.Allocator,
           vmalloc.VirtualAllocator, vmalloc.CachingAllocator, vmalloc.LoggingAllocator,
           PhysicalChunkPool, Replay, SwapManager, Pass, Kept]


def _members(cls):
    return [name for name in dir(cls) if not name.startswith("_") and name not in STATIC]


def _uses(obj, call=True):
    """Reads every public attribute of ``obj`` and, with ``call``, calls every method with 0 to
    3 zero arguments; returns the names of those that raised RuntimeError saying the object is
    not initialized. (Calls only on objects that hold nothing: on a whole device they would
    do real things, such as holding stream 0 forever.)"""
    refused = []
    for name in _members(type(obj)):
        try:
            attr = getattr(obj, name)
        except RuntimeError as error:
            if "not initialized" in str(error):
                refused.append(name)
            continue
        if not callable(attr) or not call:
            continue
        for args in ((), (0,), (0, 0), (0, 0, 0)):
            try:
                attr(*args)
            except TypeError as error:
                if "argument" in str(error) or "positional" in str(error):
                    continue  # wrong arity: try more arguments
            except RuntimeError as error:
                if "not initialized" in str(error):
                    refused.append(name)
            except Exception:  # noqa: BLE001 - a refused argument is a clean error here
                pass
            break
    return refused


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_new_without_arguments_is_complete_or_refused(cls):
    try:
        obj = cls.__new__(cls)
    except (TypeError, vmalloc.VmallocError):
        return  # needs its arguments (or a driver): nothing was made
    assert "uninitialized" not in repr(obj)
    assert _uses(obj, call=False) == []


def test_new_without_arguments_refuses_by_name():
    for cls in (vmalloc.VirtualAllocator, vmalloc.CachingAllocator, vmalloc.LoggingAllocator,
                PhysicalChunkPool, Replay, SwapManager):
        with pytest.raises(TypeError, match="positional argument"):
            cls.__new__(cls)
    # Its arguments all have defaults: __new__ alone builds a whole device.
    dev = vmalloc.HostDevice.__new__(vmalloc.HostDevice)
    assert (dev.capacity, dev.granularity, dev.backed) == (None, 2 * MiB, True)
    assert dev.read(0, 0) == b""


@pytest.mark.parametrize("base, subclasses", [
    (vmalloc.Device, "HostDevice and CudaDevice"),
    (vmalloc.Allocator, "VirtualAllocator, CachingAllocator and LoggingAllocator"),
], ids=["Device", "Allocator"])
def test_abstract_bases_cannot_be_made(base, subclasses):
    with pytest.raises(TypeError, match=f"vmalloc.{base.__name__} cannot be constructed: it is "
                                        f"the base of {subclasses}"):
        base()
    with pytest.raises(TypeError, match="cannot be constructed"):
        base.__new__(base)
    with pytest.raises(TypeError, match="cannot be constructed"):
        base.__new__(base, object())  # not the private token of the C-level wrappers


@pytest.mark.parametrize("base", [vmalloc.Device, vmalloc.Allocator], ids=lambda c: c.__name__)
def test_a_python_subclass_that_builds_nothing_refuses_every_call(base):
    bare = type("Bare", (base,), {})()
    assert repr(bare) == "<Bare (uninitialized)>"
    refused = _uses(bare)
    assert refused and all(name in _members(base) for name in refused)
    assert set(refused) >= {"name", "stats" if base is vmalloc.Allocator else "counters"}
    if base is vmalloc.Allocator:
        with pytest.raises(RuntimeError, match="Bare is not initialized: it holds no allocator"):
            vmalloc.set_current_allocator(bare)
        with pytest.raises(RuntimeError, match="not initialized"):
            vmalloc.LoggingAllocator(bare, "unused.vmtrace")
        with pytest.raises(RuntimeError, match="not initialized"):
            Replay(bare)
        with pytest.raises(RuntimeError, match="not initialized"):
            SwapManager(bare)
    else:
        with pytest.raises(RuntimeError, match="Bare is not initialized: it holds no device"):
            vmalloc.VirtualAllocator(bare)
        with pytest.raises(RuntimeError, match="not initialized"):
            PhysicalChunkPool(bare)
        with pytest.raises(RuntimeError, match="not initialized"):
            vmalloc.CachingAllocator(bare)


def _constructors(tmp_path):
    """(class, args, kwargs, other args, other kwargs): how each wrapper is made, and
    arguments of a second __init__ that would build a different object."""
    dev = vmalloc.HostDevice(capacity="64MiB")
    emulator = testing.emulated_cuda_device(capacity="64MiB")
    caching = vmalloc.CachingAllocator(dev)
    virtual = vmalloc.VirtualAllocator(dev)
    return [
        (vmalloc.HostDevice, (), {"capacity": "64MiB"}, (), {"capacity": "32MiB"}),
        (vmalloc.CudaDevice, (emulator.ordinal,), {"library": emulator.library}, (), {}),
        (vmalloc.VirtualAllocator, (dev,), {}, (dev,), {"placement": "packed"}),
        (vmalloc.VirtualAllocator, (dev,), {"placement": "packed"}, (dev,),
         {"placement": "chunks"}),
        (vmalloc.CachingAllocator, (dev,), {}, (dev,), {"policy": "cupy"}),
        (vmalloc.LoggingAllocator, (caching, tmp_path / "a.vmtrace"), {},
         (virtual, tmp_path / "b.vmtrace"), {}),
        (PhysicalChunkPool, (dev, "2MiB"), {}, (dev, "4MiB"), {}),
        (Replay, (caching,), {}, (virtual,), {"timeline_points": 0}),
        (SwapManager, (virtual,), {}, (caching,), {"host_capacity": "1MiB"}),
    ]


def _state(obj):
    """What a second __init__ must not change, and what two objects built with the same
    arguments share."""
    if isinstance(obj, PhysicalChunkPool):
        return obj.stats(), obj.device
    if isinstance(obj, Replay):
        return obj.counts(), obj.allocator, obj.timeline_stride
    if isinstance(obj, SwapManager):
        return obj.stats(), obj.allocator
    if isinstance(obj, vmalloc.Allocator):
        return repr(obj), obj.device, getattr(obj, "placement", None), obj.name
    return repr(obj), obj.name


def _exercise(obj):
    """Uses the object for real: it must be whole."""
    if isinstance(obj, vmalloc.Device):
        p = obj.reserve(2 * MiB)
        obj.free_address(p, 2 * MiB)
    elif isinstance(obj, vmalloc.Allocator):
        p = obj.allocate(3 * MiB)
        assert obj.allocation_size(p) == 3 * MiB
        obj.deallocate(p)
        if isinstance(obj, vmalloc.VirtualAllocator):
            obj.chunk_stats()
            if obj.placement == "packed":
                obj.packed_stats()
    elif isinstance(obj, PhysicalChunkPool):
        obj.give_back(obj.acquire())
        assert obj.stats()["chunks_cached"] == 1
    elif isinstance(obj, Replay):
        events = np.zeros(2, dtype=EVENT_DTYPE)
        events["op"], events["addr"], events["size"] = [ALLOC, FREE], 0x1000, MiB
        assert obj.feed(events) is True
        assert (obj.counts()["allocations"], obj.counts()["frees"]) == (1, 1)
    elif isinstance(obj, SwapManager):
        p = obj.allocate(3 * MiB)
        assert obj.state(p) == "resident"
        obj.deallocate(p)


def test_new_with_arguments_builds_the_whole_object(tmp_path):
    # __init__ is never called here: everything must have happened in __cinit__.
    for cls, args, kwargs, _, _ in _constructors(tmp_path):
        obj = cls.__new__(cls, *args, **kwargs)
        assert type(obj) is cls
        assert "uninitialized" not in repr(obj)
        if cls is not vmalloc.LoggingAllocator:  # a twin would truncate the same file
            assert _state(obj) == _state(cls(*args, **kwargs)), cls.__name__
        _exercise(obj)


def test_second_init_is_refused_and_changes_nothing(tmp_path):
    seen = set()
    for cls, args, kwargs, other_args, other_kwargs in _constructors(tmp_path):
        seen.add(cls)
        obj = cls(*args, **kwargs)
        before = _state(obj)
        for again in ((args, kwargs), (other_args, other_kwargs)):
            with pytest.raises(RuntimeError, match=f"{cls.__name__} is already initialized: "
                                                   f"__init__ cannot be called twice; create a "
                                                   f"new {cls.__name__}"):
                obj.__init__(*again[0], **again[1])
            assert _state(obj) == before, cls.__name__
        _exercise(obj)
    assert seen == set(CLASSES) - {vmalloc.Device, vmalloc.Allocator, Pass, Kept}


def test_the_first_init_after_new_is_accepted_once():
    dev = vmalloc.HostDevice.__new__(vmalloc.HostDevice, capacity="32MiB")
    dev.__init__(capacity="32MiB")  # what cls(...) does after __new__
    with pytest.raises(RuntimeError, match="HostDevice is already initialized"):
        dev.__init__(capacity="32MiB")
    assert dev.capacity == 32 * MiB


def test_a_failed_construction_leaves_no_object_and_no_memory():
    dev = vmalloc.HostDevice(capacity="64MiB", granularity="2MiB")
    for make in (lambda: vmalloc.VirtualAllocator(dev, chunk_size="3MiB"),
                 lambda: vmalloc.VirtualAllocator(dev, budget=0),
                 lambda: vmalloc.CachingAllocator(dev, policy="tensorflow"),
                 lambda: PhysicalChunkPool(dev, chunk_size=0),
                 lambda: SwapManager(vmalloc.CachingAllocator(dev), host_capacity=0)):
        with pytest.raises(vmalloc.InvalidArgumentError):
            make()
    assert dev.physical_bytes_in_use == 0
    assert dev.state()["reservations"] == 0


_SIZES = st.sampled_from([None, 0, "1MiB", "2MiB", "3MiB", "4MiB", "64MiB", -1, "2 lumps", 2.5])


@settings(max_examples=60, deadline=None)
@given(chunk_size=_SIZES, budget=_SIZES, small_threshold=_SIZES,
       placement=st.sampled_from(["chunks", "packed", "dense"]),
       steal=st.sampled_from([None, True, False, "no"]))
def test_new_and_call_agree_on_every_option(chunk_size, budget, small_threshold, placement,
                                            steal):
    # Built either way, the same options give the same allocator or the same error.
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    kwargs = dict(chunk_size=chunk_size, budget=budget, small_threshold=small_threshold,
                  placement=placement, steal_before_create=steal)
    outcomes = []
    for make in (vmalloc.VirtualAllocator, lambda *a, **k: vmalloc.VirtualAllocator.__new__(
            vmalloc.VirtualAllocator, *a, **k)):
        try:
            va = make(dev, **kwargs)
        except Exception as error:  # noqa: BLE001 - compared below
            outcomes.append((type(error), str(error)))
        else:
            outcomes.append((va.placement, va.chunk_size, va.small_threshold, va.budget,
                             va.steal_before_create))
            del va
    assert outcomes[0] == outcomes[1]
    assert dev.physical_bytes_in_use == 0
