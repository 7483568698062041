# cython: language_level=3
"""HostDevice: a GPU emulated on host memory with the CUDA driver's virtual memory rules."""

from libc.stdint cimport uint64_t, uintptr_t
from libcpp cimport bool as cbool

from vmalloc._core.device cimport Device, stream_handle
from vmalloc._core.init_once cimport refuse_second_init
from vmalloc._lib.device.device cimport CDevice
from vmalloc._lib.device.host_device cimport (
    CHostDevice,
    CHostDeviceOptions,
    CHostDeviceState,
    host_device_process_vmas,
    host_device_set_vma_limit,
    host_device_vma_limit,
)

import os

from vmalloc.errors import DeviceError
from vmalloc.sizes import parse_size


cdef class HostDevice(Device):
    """A GPU emulated on host memory, enforcing the CUDA driver's virtual memory rules.

    Args:
        capacity: physical bytes the device holds (int or a string such as ``"16GiB"``);
            ``None`` or 0 means unlimited. Creating beyond it raises
            :class:`vmalloc.OutOfMemoryError`.
        granularity: the allocation granularity, a power-of-two multiple of the host page
            size (default ``"2MiB"``, what NVIDIA GPUs report).
        backed: ``True`` (default) keeps real memory: data written through one mapping reads
            back through another mapping of the same allocation. ``False`` keeps the books
            only, so traces far larger than the machine replay; reading or writing data then
            raises :class:`vmalloc.DeviceError`.
        ordinal: the device number, for the name ``"host:<ordinal>"``.
        checked: checked mode (see ``docs/host_device.rst``): pages of memory that an
            allocator on this device freed, or a swap moved away, become inaccessible, so a
            program touching memory it does not own dies with ``SIGSEGV`` and a line naming
            the freed allocation, and a copy there raises :class:`vmalloc.DeviceError`.
            ``None`` (default) takes it from the environment variable ``VMALLOC_CHECKED``
            (on when set and not ``0``; the test suite sets it). No effect when not backed.

    Every broken driver rule raises :class:`vmalloc.DeviceError` with the entry point
    (``.call``, e.g. ``"cuMemMap"``) and the ``CUresult`` (``.code``), and changes nothing.
    """

    def __cinit__(self, capacity=None, granularity="2MiB", backed=True, ordinal=0,
                  checked=None):
        cdef CHostDeviceOptions options
        options.capacity = parse_size(capacity, "capacity", allow_none=True) or 0
        options.granularity = parse_size(granularity, "granularity")
        options.backed = bool(backed)
        if not isinstance(ordinal, int) or isinstance(ordinal, bool):
            raise TypeError(f"ordinal must be an int, got {type(ordinal).__name__}")
        options.ordinal = ordinal
        if checked is None:
            checked = os.environ.get("VMALLOC_CHECKED", "") not in ("", "0")
        elif not isinstance(checked, bool):
            raise TypeError(f"checked must be a bool or None, got {type(checked).__name__}")
        options.checked = checked
        cdef CHostDevice* device
        with nogil:
            device = new CHostDevice(options)
        self.c_device.reset(<CDevice*>device)

    def __init__(self, capacity=None, granularity="2MiB", backed=True, ordinal=0,
                 checked=None):
        refuse_second_init(self, &self.init_called)

    cdef CHostDevice* host(self) except NULL:
        return <CHostDevice*>self.get()

    @property
    def checked(self):
        """Whether this device runs in checked mode (freed memory faults)."""
        return self.host().checked()

    def state(self):
        """The device's books as a dict: ``physical_allocations`` (created, not yet freed),
        ``released_still_mapped``, ``reservations``, ``mappings``, ``bytes_created``,
        ``bytes_reserved``, ``bytes_mapped``, ``bytes_accessible``, ``host_allocations``,
        ``host_bytes``, ``streams`` (created, the default stream not counted), ``events`` and
        ``vmas`` (kernel memory mappings held, an upper bound; 0 when unbacked); in checked
        mode also ``live_allocations`` (what allocators said is live), ``bytes_guarded``
        (freed bytes made inaccessible, whole pages), ``unguarded_frees`` (frees left open
        because the process's memory-mapping budget was spent), ``guard_runs`` (guarded page
        runs now, each up to two kernel mappings), ``guard_runs_cap`` (the most at a time:
        ``vma_limit() // 8``) and ``guards_recycled`` (runs opened again, oldest first, to stay
        under the cap or to make room for a mapping).

        Two snapshots compare equal when nothing changed in between: tests use this to show
        that a refused call left the device as it was.
        """
        cdef CHostDevice* h = self.host()
        cdef CHostDeviceState s
        with nogil:
            s = h.state()
        state = {
            "physical_allocations": s.physical_allocations,
            "released_still_mapped": s.released_still_mapped,
            "reservations": s.reservations,
            "mappings": s.mappings,
            "bytes_created": s.bytes_created,
            "bytes_reserved": s.bytes_reserved,
            "bytes_mapped": s.bytes_mapped,
            "bytes_accessible": s.bytes_accessible,
            "host_allocations": s.host_allocations,
            "host_bytes": s.host_bytes,
            "streams": s.streams,
            "events": s.events,
            "vmas": s.vmas,
        }
        if h.checked():
            state["live_allocations"] = s.live_allocations
            state["bytes_guarded"] = s.bytes_guarded
            state["unguarded_frees"] = s.unguarded_frees
            state["guard_runs"] = s.guard_runs
            state["guard_runs_cap"] = s.guard_runs_cap
            state["guards_recycled"] = s.guards_recycled
        return state

    def write(self, ptr, data, stream=0):
        """Copies the bytes of ``data`` (any buffer) to device address ``ptr``; blocks until
        done. Raises :class:`vmalloc.DeviceError` on an unbacked device."""
        if not self.backed:
            raise DeviceError(f"cannot write data to {self.name}: the device is not backed "
                              "(backed=False keeps accounting only)",
                              "cuMemcpyHtoDAsync", 801)
        Device.write(self, ptr, data, stream)

    def read(self, ptr, nbytes, stream=0):
        """Returns ``nbytes`` bytes read from device address ``ptr``; blocks until done.
        Raises :class:`vmalloc.DeviceError` on an unbacked device."""
        if not self.backed:
            raise DeviceError(f"cannot read data from {self.name}: the device is not backed "
                              "(backed=False keeps accounting only)",
                              "cuMemcpyDtoHAsync", 801)
        return Device.read(self, ptr, nbytes, stream)

    def copy_to_host(self, uintptr_t dst, uintptr_t src, nbytes, stream=0):
        """cuMemcpyDtoHAsync to host address ``dst``. Asynchronous when ``dst`` is pinned
        memory from :meth:`host_alloc` (keep it alive until done); into pageable memory it
        returns only once the copy is done, as with the driver."""
        cdef size_t n = parse_size(nbytes, "nbytes")
        cdef uintptr_t s = stream_handle(stream)
        cdef CDevice* d = self.get()
        with nogil:  # a pageable copy waits for the stream
            d.copy_to_host(<void*>dst, src, n, s)

    def create_stream(self, non_blocking=False):
        """Creates a stream and returns its handle. A blocking stream (the default, like
        ``cuStreamCreate(CU_STREAM_DEFAULT)``) is ordered with the default stream 0: its work
        waits for stream 0's earlier work, and stream 0's work waits for its earlier work. A
        ``non_blocking`` stream (``CU_STREAM_NON_BLOCKING``, what :class:`CudaDevice` creates)
        has no such implicit ordering: order it with events."""
        cdef CHostDevice* h = self.host()
        cdef cbool nb = bool(non_blocking)
        cdef uintptr_t s
        with nogil:
            s = h.create_stream(nb)
        return s

    def hold_stream(self, stream=0):
        """Blocks ``stream`` until :meth:`release_hold` (a testing aid, like a kernel that
        runs until told to stop), so that work queued behind it can be observed before it
        runs. Returns the hold's id. Destroying the device releases every hold."""
        cdef uintptr_t s = stream_handle(stream)
        cdef CHostDevice* h = self.host()
        cdef uint64_t hold
        with nogil:
            hold = h.hold_stream(s)
        return hold

    def release_hold(self, uint64_t hold):
        """Lets the stream blocked by :meth:`hold_stream` go on."""
        cdef CHostDevice* h = self.host()
        with nogil:
            h.release_hold(hold)

    @staticmethod
    def vma_limit():
        """Kernel memory mappings all HostDevices of the process may hold together before
        calls are refused (``vm.max_map_count`` minus headroom for the process itself)."""
        return host_device_vma_limit()

    @staticmethod
    def set_vma_limit(size_t limit):
        """Sets :meth:`vma_limit` (for tests of the refusal)."""
        host_device_set_vma_limit(limit)

    @staticmethod
    def process_vmas():
        """Kernel memory mappings all HostDevices of the process hold now (an upper bound)."""
        return host_device_process_vmas()
