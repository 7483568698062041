"""Measurements of one :class:`vmalloc.CudaDevice`: what the driver says about the GPU, what its
virtual memory calls cost, and the host link's copy bandwidth.

Used by ``vmalloc doctor`` and ``scripts/gpu-check``. Every function takes the device (a real
GPU, or the driver emulator standing in for one) and measures through vmalloc's own
``Device`` methods, so a figure includes what vmalloc adds around each driver call (making
the primary context current, Python's call), as an allocator pays it.
"""

import ctypes
import statistics
import time

__all__ = ["driver_info", "round_trip", "driver_costs", "bandwidth", "CALLS"]

MiB = 1 << 20
GB = 1e9

#: The virtual memory calls :func:`driver_costs` times, in the order a mapping is made and undone.
CALLS = ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
         "cuMemRelease", "cuMemAddressFree")

# cuDeviceGetAttribute codes (cuda.h): only asked where the library exports the entry point
# (the driver emulator implements only the calls vmalloc makes, and this is not one).
_ATTRIBUTES = {
    "compute_capability_major": 75,
    "compute_capability_minor": 76,
    "multiprocessor_count": 16,
    "vmm_supported": 102,
    "pci_bus_id": 33,
}


def _attributes(library, ordinal):
    """``cuDeviceGetAttribute`` answers, or a reason why there are none."""
    try:
        lib = ctypes.CDLL(library)
        get = lib.cuDeviceGetAttribute
    except (OSError, AttributeError):
        return None, f"{library} does not export cuDeviceGetAttribute"
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    out = {}
    for name, code in _ATTRIBUTES.items():
        value = ctypes.c_int()
        result = get(ctypes.byref(value), code, ordinal)
        out[name] = value.value if result == 0 else None
    return out, None


def driver_info(device):
    """What the driver says about ``device``: a dict of name, memory, driver version,
    granularities, compute capability and VMM support (None where the driver cannot say)."""
    library = device.library
    attrs, why = _attributes(_loaded_path(library), device.ordinal)
    info = {
        "library": library,
        "library_path": _loaded_path(library),
        "name": device.device_name,
        "ordinal": device.ordinal,
        "memory_bytes": device.capacity,
        "driver_version": device.driver_version,
        "driver_version_text": _version_text(device.driver_version),
        "granularity_minimum_bytes": device.granularity,
        "granularity_recommended_bytes": device.recommended_granularity,
        "compute_capability": None,
        "vmm_supported": None,
        "multiprocessor_count": None,
        "attributes_note": why,
    }
    if attrs:
        major, minor = attrs["compute_capability_major"], attrs["compute_capability_minor"]
        if major is not None:
            info["compute_capability"] = f"{major}.{minor}"
        info["vmm_supported"] = None if attrs["vmm_supported"] is None \
            else bool(attrs["vmm_supported"])
        info["multiprocessor_count"] = attrs["multiprocessor_count"]
    return info


def _version_text(version):
    return f"{version // 1000}.{(version % 1000) // 10}" if version else None


def _loaded_path(library):
    """The file the process loaded for ``library`` (a bare ``libcuda.so.1`` resolved through
    /proc/self/maps), so that a report names the driver that actually ran."""
    if "/" in library:
        return library
    stem = library.split(".so")[0] + ".so"        # libcuda.so.1 -> libcuda.so.580.65.06
    try:
        with open("/proc/self/maps") as maps:
            paths = {parts[5] for parts in (line.split() for line in maps) if len(parts) >= 6}
    except OSError:
        return library
    found = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(stem))
    return found[0] if len(found) == 1 else library
    return library


def _timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def round_trip(device, size=None):
    """One reserve / create / map / set-access / unmap / release / free of ``size`` bytes
    (default the granularity); returns ``{call: seconds}``. Raises what the device raises,
    after undoing what was done."""
    size = size or device.granularity
    out = {}
    ptr = handle = None
    mapped = False
    try:
        ptr, out["cuMemAddressReserve"] = _timed(device.reserve, size)
        handle, out["cuMemCreate"] = _timed(device.create, size)
        _, out["cuMemMap"] = _timed(device.map, ptr, size, handle)
        mapped = True
        _, out["cuMemSetAccess"] = _timed(device.set_access, ptr, size)
        _, out["cuMemUnmap"] = _timed(device.unmap, ptr, size)
        mapped = False
        _, out["cuMemRelease"] = _timed(device.release, handle)
        handle = None
        _, out["cuMemAddressFree"] = _timed(device.free_address, ptr, size)
        ptr = None
    finally:
        if mapped:
            device.unmap(ptr, size)
        if handle is not None:
            device.release(handle)
        if ptr is not None:
            device.free_address(ptr, size)
    return out


def driver_costs(device, sizes=(2 * MiB, 20 * MiB, 512 * MiB), repeats=10, deadline=None):
    """Microseconds per virtual memory call at each size: ``{size: {call: {median_us, min_us,
    mean_us, samples}}}``. The first round trip of each size is a warm-up and not counted.
    Stops early (fewer samples) when ``time.monotonic()`` passes ``deadline``."""
    results = {}
    for size in sizes:
        round_trip(device, size)
        samples = {call: [] for call in CALLS}
        for _ in range(repeats):
            for call, seconds in round_trip(device, size).items():
                samples[call].append(seconds * 1e6)
            if deadline is not None and time.monotonic() > deadline:
                break
        results[int(size)] = {call: _summary(values) for call, values in samples.items()}
    return results


def _summary(values):
    return {"median_us": statistics.median(values), "min_us": min(values),
            "mean_us": statistics.fmean(values), "samples": len(values)}


class _DeviceBuffer:
    """``nbytes`` of device memory mapped read-write (rounded up to the granularity)."""

    def __init__(self, device, nbytes):
        g = device.granularity
        self.device, self.size = device, -(-nbytes // g) * g
        self.ptr = device.reserve(self.size)
        try:
            self.handle = device.create(self.size)
            try:
                device.map(self.ptr, self.size, self.handle)
                device.set_access(self.ptr, self.size)
            except BaseException:
                device.release(self.handle)
                raise
        except BaseException:
            device.free_address(self.ptr, self.size)
            raise

    def close(self):
        d = self.device
        d.unmap(self.ptr, self.size)
        d.release(self.handle)
        d.free_address(self.ptr, self.size)


def bandwidth(device, nbytes=256 * MiB, repeats=5, pageable=True, both=True):
    """Host<->device copy bandwidth in GB/s (1e9 bytes/s), best of ``repeats``: pinned H2D and
    D2H with one direction busy, each direction with both busy at once (two streams), and
    pageable (ordinary host memory) H2D and D2H. Returns a dict of those figures and
    ``bytes`` per copy."""
    d = device
    out = {"bytes": int(nbytes), "repeats": int(repeats)}
    streams, pinned, buffers = [], [], []
    try:
        for _ in range(2):
            streams.append(d.create_stream())
            pinned.append(d.host_alloc(nbytes))
            buffers.append(_DeviceBuffer(d, nbytes))
        s0, s1 = streams
        h0, h1 = pinned
        b0, b1 = buffers

        def best(issue, sync_streams):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                issue()
                for s in sync_streams:
                    d.synchronize_stream(s)
                times.append(time.perf_counter() - start)
            return nbytes / min(times) / GB

        out["pinned_h2d_gbps"] = best(lambda: d.copy_to_device(b0.ptr, h0, nbytes, s0), [s0])
        out["pinned_d2h_gbps"] = best(lambda: d.copy_to_host(h0, b0.ptr, nbytes, s0), [s0])
        if both:
            def both_ways():
                d.copy_to_device(b0.ptr, h0, nbytes, s0)
                d.copy_to_host(h1, b1.ptr, nbytes, s1)
            # Both copies of nbytes finish together at best: each direction moved nbytes.
            out["pinned_both_each_direction_gbps"] = best(both_ways, [s0, s1])
        if pageable:
            host = (ctypes.c_char * nbytes)()
            address = ctypes.addressof(host)
            out["pageable_h2d_gbps"] = best(
                lambda: d.copy_to_device(b0.ptr, address, nbytes, s0), [s0])
            out["pageable_d2h_gbps"] = best(
                lambda: d.copy_to_host(address, b0.ptr, nbytes, s0), [s0])
    finally:
        for b in buffers:
            b.close()
        for h in pinned:
            d.host_free(h)
        for s in streams:
            d.destroy_stream(s)
    return out
