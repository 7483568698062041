"""The chunks a placement gathers (ChunkBatch: the pool's cache, stolen, created) go back
where they came from when the placement fails part way: cached and stolen chunks to the pool's
cache, created ones to the device. Checked through both virtual allocators on the driver
emulator, with the n-th cuMemCreate (or cuMemMap) of the gathering failing."""

import pytest

import vmalloc
from vmalloc import testing

MiB = 1 << 20

#: The chunk figures a failed placement must leave as they were (or as stated).
FIGURES = ("chunks_held", "chunks_in_pool", "chunks_cached", "chunks_live", "chunks_created",
           "chunks_released", "chunks_stolen")


def _figures(va):
    c = va.chunk_stats()
    return {k: c[k] for k in FIGURES}


def _still_works(device, va, live):
    """The allocator works on; then everything live is freed."""
    ptr = va.allocate(3 * MiB)
    device.write(ptr + 3 * MiB - 2, b"ok")
    assert device.read(ptr + 3 * MiB - 2, 2) == b"ok"
    for p in [ptr, *live]:
        va.deallocate(p)


def _nothing_held(emu, device):
    """Once the allocator is gone the emulated GPU holds nothing."""
    device.synchronize()
    held = {k: v for k, v in emu.device_state(device.ordinal).items()
            if k in testing.RESOURCE_FIELDS and k != "primary_context_refs"}
    assert not any(held.values()), emu.leak_report(device.ordinal)


def _chunks_world():
    """Chunk placement with 3 chunks in the pool's cache (an unbacked allocation's) and a
    cached range of 2 chunks: 5 held, 5 created."""
    device = testing.emulated_cuda_device(capacity="64MiB", granularity="2MiB")
    va = vmalloc.VirtualAllocator(device, chunk_size="2MiB")
    va.deallocate(va.allocate(4 * MiB))
    unbacked = va.allocate(6 * MiB)
    va.unmap_backing(unbacked)
    assert _figures(va) == {"chunks_held": 5, "chunks_in_pool": 3, "chunks_cached": 2,
                            "chunks_live": 0, "chunks_created": 5, "chunks_released": 0,
                            "chunks_stolen": 0}
    return device, va, unbacked


@pytest.mark.parametrize("n", range(1, 8))
def test_a_device_error_while_creating_gives_every_chunk_back(emu, n):
    # 20 MiB = 10 chunks: 3 from the pool's cache, then 7 to create; the n-th creation fails.
    device, va, unbacked = _chunks_world()
    before, stats = _figures(va), va.stats()
    with emu.fault("cuMemCreate", n, "CUDA_ERROR_UNKNOWN"):
        with pytest.raises(vmalloc.DeviceError) as info:
            va.allocate(20 * MiB)
    assert info.value.call == "cuMemCreate"
    # The cached chunks are back in the pool; the n - 1 created ones were released again.
    assert _figures(va) == before | {"chunks_created": 5 + n - 1, "chunks_released": n - 1}
    assert va.stats().reserved_bytes == stats.reserved_bytes == device.physical_bytes_in_use
    assert va.stats().out_of_memory_count == 0
    va.map_backing(unbacked)  # the pool's chunks are usable: no new chunk needed
    assert va.chunk_stats()["chunks_created"] == 5 + n - 1
    _still_works(device, va, [unbacked])
    del va
    _nothing_held(emu, device)


@pytest.mark.parametrize("n", range(1, 6))
def test_a_device_fuller_than_it_said_gives_every_chunk_back(emu, n):
    # The n-th creation reports out of memory: the gathering steals the cached range's 2
    # chunks instead and still falls short (3 + n - 1 + 2 < 10): the stolen chunks, now
    # unmapped, join the pool's cache with the 3 taken from it; the created ones go back.
    device, va, unbacked = _chunks_world()
    before, stats = _figures(va), va.stats()
    with emu.fault("cuMemCreate", n, "CUDA_ERROR_OUT_OF_MEMORY"):
        with pytest.raises(vmalloc.OutOfMemoryError, match="refused chunks it reported free"):
            va.allocate(20 * MiB)
    assert _figures(va) == before | {"chunks_in_pool": 5, "chunks_cached": 0,
                                     "chunks_created": 5 + n - 1, "chunks_released": n - 1,
                                     "chunks_stolen": 2}
    assert va.stats().reserved_bytes == stats.reserved_bytes == device.physical_bytes_in_use
    assert va.stats().out_of_memory_count == 1  # counted once
    _still_works(device, va, [unbacked])
    del va
    _nothing_held(emu, device)


def _packed_world():
    """Packed placement, create-first, with 2 free mapped slots at the start of its
    reservation: 2 chunks held and created."""
    device = testing.emulated_cuda_device(capacity="64MiB", granularity="2MiB")
    va = vmalloc.VirtualAllocator(device, chunk_size="2MiB", placement="packed",
                                  steal_before_create=False)
    va.deallocate(va.allocate(4 * MiB))
    assert _figures(va) == {"chunks_held": 2, "chunks_in_pool": 0, "chunks_cached": 2,
                            "chunks_live": 0, "chunks_created": 2, "chunks_released": 0,
                            "chunks_stolen": 0}
    return device, va


@pytest.mark.parametrize("n", range(1, 9))
def test_packed_a_device_error_while_creating_releases_what_was_created(emu, n):
    # 20 MiB lands on slots 0..9: 2 mapped, 8 to create; the n-th creation fails.
    device, va = _packed_world()
    before, stats = _figures(va), va.stats()
    with emu.fault("cuMemCreate", n, "CUDA_ERROR_UNKNOWN"):
        with pytest.raises(vmalloc.DeviceError):
            va.allocate(20 * MiB)
    assert _figures(va) == before | {"chunks_created": 2 + n - 1, "chunks_released": n - 1}
    assert va.stats().reserved_bytes == stats.reserved_bytes == device.physical_bytes_in_use
    _still_works(device, va, [])
    del va
    _nothing_held(emu, device)


@pytest.mark.parametrize("n", range(1, 9))
def test_packed_a_failed_map_unmaps_and_releases_the_whole_batch(emu, n):
    # All 8 chunks created, then the n-th cuMemMap fails: the n - 1 mapped slots are unmapped
    # again and all 8 new chunks released.
    device, va = _packed_world()
    before, stats = _figures(va), va.stats()
    mappings = emu.device_state(device.ordinal)["mappings"]
    with emu.fault("cuMemMap", n, "CUDA_ERROR_UNKNOWN"):
        with pytest.raises(vmalloc.DeviceError) as info:
            va.allocate(20 * MiB)
    assert info.value.call == "cuMemMap"
    assert _figures(va) == before | {"chunks_created": 10, "chunks_released": 8}
    assert va.stats().reserved_bytes == stats.reserved_bytes == device.physical_bytes_in_use
    assert emu.device_state(device.ordinal)["mappings"] == mappings
    _still_works(device, va, [])
    del va
    _nothing_held(emu, device)
