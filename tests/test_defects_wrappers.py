"""Every wrapper class is safe when uninitialised (``cls.__new__(cls)``) and against a second
``__init__``: a clear error, never a crash or stale state."""

import pytest

import vmalloc
from vmalloc import testing
from vmalloc._replay import Replay
from vmalloc._virtual_allocator import PhysicalChunkPool

MiB = 1 << 20

#: Static methods (no instance state; some change process-wide settings).
STATIC = {"vma_limit", "set_vma_limit", "process_vmas", "driver_entry_points", "default_library"}

CLASSES = [vmalloc.Device, vmalloc.HostDevice, vmalloc.CudaDevice, vmalloc.Allocator,
           vmalloc.VirtualAllocator, vmalloc.CachingAllocator, vmalloc.LoggingAllocator,
           PhysicalChunkPool, Replay]


def _members(cls):
    return [name for name in dir(cls) if not name.startswith("_") and name not in STATIC]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_uninitialised_wrapper_raises_a_clear_error(cls):
    try:
        obj = cls.__new__(cls)
    except TypeError:
        return  # cannot be made without its arguments: nothing to misuse
    assert "uninitialized" in repr(obj) or repr(obj)
    checked = 0
    for name in _members(cls):
        try:
            attr = getattr(obj, name)
        except RuntimeError as error:
            assert "not initialized" in str(error), (name, error)
            checked += 1
            continue
        if not callable(attr) or name in ("device", "upstream", "path", "placement",
                                          "allocator"):
            continue
        for args in ((), (0,), (0, 0), (0, 0, 0)):
            try:
                attr(*args)
            except TypeError as error:
                if "argument" in str(error) or "positional" in str(error):
                    continue  # wrong arity: try more arguments
                break  # an argument refused before the wrapper is used: a clean error
            except RuntimeError as error:
                assert "not initialized" in str(error), (name, error)
                checked += 1
                break
            else:
                pytest.fail(f"{cls.__name__}.{name}{args} worked on an uninitialised wrapper")
            break
    assert checked > 0


def test_uninitialised_named_examples():
    with pytest.raises(RuntimeError, match="VirtualAllocator is not initialized"):
        vmalloc.VirtualAllocator.__new__(vmalloc.VirtualAllocator).chunk_size
    with pytest.raises(RuntimeError, match="PhysicalChunkPool is not initialized"):
        PhysicalChunkPool.__new__(PhysicalChunkPool).stats()
    with pytest.raises(RuntimeError, match="not initialized"):
        vmalloc.VirtualAllocator(vmalloc.Device.__new__(vmalloc.Device))
    with pytest.raises(RuntimeError, match="not initialized"):
        PhysicalChunkPool(vmalloc.HostDevice.__new__(vmalloc.HostDevice))


def _instances(tmp_path):
    dev = vmalloc.HostDevice(capacity="64MiB")
    cuda = testing.emulated_cuda_device(capacity="64MiB")
    va = vmalloc.VirtualAllocator(dev)
    return [
        (dev, (), {"capacity": "32MiB"}),
        (cuda, (), {}),
        (va, (dev,), {"placement": "packed"}),
        (vmalloc.VirtualAllocator(dev, placement="packed"), (dev,), {"placement": "chunks"}),
        (vmalloc.CachingAllocator(dev), (dev,), {"policy": "cupy"}),
        (vmalloc.LoggingAllocator(vmalloc.CachingAllocator(dev), tmp_path / "a.vmtrace"),
         (va, tmp_path / "b.vmtrace"), {}),
        (PhysicalChunkPool(dev, "2MiB"), (dev, "4MiB"), {}),
    ]


def test_second_init_is_refused_and_changes_nothing(tmp_path):
    for obj, args, kwargs in _instances(tmp_path):
        name = type(obj).__name__
        before = repr(obj) if not isinstance(obj, PhysicalChunkPool) else obj.stats()
        placement = getattr(obj, "placement", None)
        with pytest.raises(RuntimeError, match=f"{name} is already initialized"):
            obj.__init__(*args, **kwargs)
        after = repr(obj) if not isinstance(obj, PhysicalChunkPool) else obj.stats()
        assert before == after, name
        assert getattr(obj, "placement", None) == placement, name
        if isinstance(obj, vmalloc.Allocator):
            p = obj.allocate(3 * MiB)
            obj.deallocate(p)
            if isinstance(obj, vmalloc.VirtualAllocator):
                obj.chunk_stats()
                if obj.placement == "packed":
                    obj.packed_stats()
    # Replay has no __init__: calling object's changes nothing.
    dev = vmalloc.HostDevice(capacity="64MiB")
    r = Replay(vmalloc.CachingAllocator(dev))
    r.__init__(vmalloc.VirtualAllocator(dev))
    assert r.counts()["events"] == 0
