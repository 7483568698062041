# cython: language_level=3
"""The Python face of the device interface; HostDevice and CudaDevice derive from it."""

from libc.stdint cimport uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string

from vmalloc._lib.base.driver_calls cimport (
    CostModel,
    CounterSnapshot,
    driver_call_count,
    driver_call_name_at,
)
from vmalloc._lib.base.detail.format cimport human_bytes
from vmalloc._lib.device.device cimport CDevice

from vmalloc.sizes import parse_size


# Passed by wrap_device to Device.__new__: the only way to make a plain Device, which Python
# code cannot reach (a cdef module global is not a module attribute).
cdef object _WRAP = object()


cdef uintptr_t stream_handle(object stream) except? 0:
    if type(stream) is int:
        return <uintptr_t>stream
    if stream is None:
        return 0
    for attribute in ("ptr", "cuda_stream", "handle"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return <uintptr_t>value
    raise TypeError(f"stream must be an int (a CUstream handle) or a CuPy/PyTorch stream, "
                    f"got {type(stream).__name__}")


cdef Device wrap_device(shared_ptr[CDevice] c_device):
    if not c_device:
        raise RuntimeError("wrap_device: no C++ device to wrap")
    cdef Device device = Device.__new__(Device, _WRAP)
    device.c_device = c_device
    device.init_called = True
    return device


def _call_names():
    return [driver_call_name_at(i).decode() for i in range(driver_call_count)]


def _human_bytes(size_t nbytes, bool exact=False):
    """The C++ byte formatter (``vmalloc::detail::human_bytes``, in the library's messages),
    for the test that holds :func:`vmalloc.format_size` to it."""
    return human_bytes(nbytes, exact).decode()


cdef class Device:
    """A GPU, real (:class:`CudaDevice`) or emulated (:class:`HostDevice`).

    Not constructed directly: ``Device()`` raises TypeError. All methods are thread-safe;
    failures raise :class:`vmalloc.DeviceError` naming the driver call and its ``CUresult``.
    """

    # A subclass builds its C++ device in __cinit__, so a wrapper that exists holds one (even
    # one made with cls.__new__(cls)); __init__ only refuses to be called a second time.

    def __cinit__(self, *args, **kwargs):
        # Runs before the subclass's __cinit__, with its arguments. A plain Device would hold
        # no device: only wrap_device makes one.
        if type(self) is Device and not (len(args) == 1 and args[0] is _WRAP and not kwargs):
            raise TypeError("vmalloc.Device cannot be constructed: it is the base of "
                            "HostDevice and CudaDevice; construct one of those")

    # Every call into the device releases the GIL: the device's calls take its locks and may
    # wait for streams, and a thread waiting with the GIL held would stop the Python thread
    # that makes the device go on.

    cdef CDevice* get(self) except NULL:
        # Only a Python subclass that builds no device reaches the error.
        if not self.c_device:
            raise RuntimeError(f"{type(self).__name__} is not initialized: it holds no device "
                               f"(subclass HostDevice or CudaDevice, not Device)")
        return self.c_device.get()

    def __dealloc__(self):
        # The last reference destroys the device, which waits for its streams.
        with nogil:
            self.c_device.reset()

    @property
    def name(self):
        """``"host:0"``, ``"cuda:0"``, ..."""
        cdef CDevice* d = self.get()
        cdef string n
        with nogil:
            n = d.name()
        return n.decode()

    @property
    def ordinal(self):
        cdef CDevice* d = self.get()
        cdef int o
        with nogil:
            o = d.ordinal()
        return o

    @property
    def granularity(self):
        """Minimum allocation granularity in bytes (sizes of physical chunks are multiples)."""
        cdef CDevice* d = self.get()
        cdef size_t g
        with nogil:
            g = d.granularity()
        return g

    @property
    def recommended_granularity(self):
        cdef CDevice* d = self.get()
        cdef size_t g
        with nogil:
            g = d.recommended_granularity()
        return g

    @property
    def capacity(self):
        """Physical bytes the device can hold, or None when unlimited."""
        cdef CDevice* d = self.get()
        cdef size_t c
        with nogil:
            c = d.capacity()
        return None if c == 0 else c

    @property
    def backed(self):
        """False for an accounting-only device (its memory cannot be read or written)."""
        cdef CDevice* d = self.get()
        cdef bool b
        with nogil:
            b = d.backed()
        return b

    @property
    def physical_bytes_in_use(self):
        """Bytes of physical memory created and not yet freed."""
        cdef CDevice* d = self.get()
        cdef size_t n
        with nogil:
            n = d.physical_bytes_in_use()
        return n

    def counters(self):
        """Driver-equivalent calls made so far, by name (``create``, ``release``, ``reserve``,
        ``free_address``, ``map``, ``unmap``, ``set_access``, ...), plus ``bytes_to_device``,
        ``bytes_to_host``, ``bytes_device``, ``memory_management_calls``, ``modeled_seconds``
        (the calls' cost under :meth:`cost_model`) and ``modeled_copy_seconds``."""
        cdef CDevice* d = self.get()
        cdef CounterSnapshot s
        with nogil:
            s = d.counters()
        result = {driver_call_name_at(i).decode(): s.call_count_at(i)
                  for i in range(driver_call_count)}
        result["memory_management_calls"] = s.memory_management_calls()
        result["bytes_to_device"] = s.bytes_to_device
        result["bytes_to_host"] = s.bytes_to_host
        result["bytes_device"] = s.bytes_device
        result["modeled_seconds"] = s.modeled_seconds
        result["modeled_copy_seconds"] = s.modeled_copy_seconds
        return result

    def modeled_cost(self):
        """``(modeled_seconds, memory_management_calls)`` of :meth:`counters`, from the same
        snapshot, without building its dict: the simulator reads it around every allocation
        (building the dict was 4 us a call, most of a simulation's Python time)."""
        cdef CDevice* d = self.get()
        cdef CounterSnapshot s
        with nogil:
            s = d.counters()
        return s.modeled_seconds, s.memory_management_calls()

    def reset_counters(self):
        cdef CDevice* d = self.get()
        with nogil:
            d.reset_counters()

    def cost_model(self):
        """Seconds per call by call name, and copy bandwidths in bytes per second."""
        cdef CDevice* d = self.get()
        cdef CostModel m
        with nogil:
            m = d.cost_model()
        result = {driver_call_name_at(i).decode(): m.seconds_at(i)
                  for i in range(driver_call_count)}
        result["to_device_bytes_per_second"] = m.to_device_bytes_per_second
        result["to_host_bytes_per_second"] = m.to_host_bytes_per_second
        result["device_bytes_per_second"] = m.device_bytes_per_second
        return result

    def set_cost_model(self, **costs):
        """Overrides model costs: ``dev.set_cost_model(create=7.6e-6, map=1.05e-6)``."""
        cdef CDevice* d = self.get()
        cdef CostModel m
        with nogil:
            m = d.cost_model()
        names = _call_names()
        for key, value in costs.items():
            value = float(value)
            if value < 0:
                raise ValueError(f"cost {key}={value} must not be negative")
            if key in names:
                m.set_seconds_at(names.index(key), value)
            elif key == "to_device_bytes_per_second":
                m.to_device_bytes_per_second = value
            elif key == "to_host_bytes_per_second":
                m.to_host_bytes_per_second = value
            elif key == "device_bytes_per_second":
                m.device_bytes_per_second = value
            else:
                raise ValueError(f"unknown cost {key!r}; known: {', '.join(names)}")
        with nogil:
            d.set_cost_model(m)

    # --- blocking data access, for users and tests ---

    def write(self, ptr, data, stream=0):
        """Copies the bytes of ``data`` (any buffer) to device address ``ptr``; blocks until done."""
        cdef const unsigned char[::1] view = memoryview(data).cast("B")
        cdef uintptr_t dst = ptr
        cdef uintptr_t s = stream_handle(stream)
        cdef size_t n = view.shape[0]
        cdef CDevice* d = self.get()
        if n == 0:
            return
        with nogil:
            d.copy_to_device(dst, &view[0], n, s)
            d.synchronize_stream(s)

    def read(self, ptr, nbytes, stream=0):
        """Returns ``nbytes`` bytes read from device address ``ptr``; blocks until done."""
        cdef size_t n = parse_size(nbytes, "nbytes")
        out = bytearray(n)
        cdef unsigned char[::1] view = out
        cdef uintptr_t src = ptr
        cdef uintptr_t s = stream_handle(stream)
        cdef CDevice* d = self.get()
        if n == 0:
            return b""
        with nogil:
            d.copy_to_host(&view[0], src, n, s)
            d.synchronize_stream(s)
        return bytes(out)

    # --- the driver-shaped calls themselves (for tests and advanced users) ---

    def create(self, size):
        """cuMemCreate: a physical allocation of ``size`` bytes; returns its handle."""
        cdef size_t n = parse_size(size)
        cdef CDevice* d = self.get()
        with nogil:
            h = d.create(n)
        return h

    def release(self, uint64_t handle):
        """cuMemRelease."""
        cdef CDevice* d = self.get()
        with nogil:
            d.release(handle)

    def reserve(self, size, alignment=0):
        """cuMemAddressReserve: returns the base address of a new reservation."""
        cdef size_t n = parse_size(size)
        cdef size_t a = parse_size(alignment, "alignment")
        cdef CDevice* d = self.get()
        with nogil:
            p = d.reserve(n, a)
        return p

    def free_address(self, uintptr_t ptr, size):
        """cuMemAddressFree."""
        cdef size_t n = parse_size(size)
        cdef CDevice* d = self.get()
        with nogil:
            d.free_address(ptr, n)

    def map(self, uintptr_t ptr, size, uint64_t handle):
        """cuMemMap (offset 0): maps the whole allocation ``handle`` at ``ptr``."""
        cdef size_t n = parse_size(size)
        cdef CDevice* d = self.get()
        with nogil:
            d.map(ptr, n, handle)

    def unmap(self, uintptr_t ptr, size):
        """cuMemUnmap."""
        cdef size_t n = parse_size(size)
        cdef CDevice* d = self.get()
        with nogil:
            d.unmap(ptr, n)

    def set_access(self, uintptr_t ptr, size):
        """cuMemSetAccess: read-write for this device."""
        cdef size_t n = parse_size(size)
        cdef CDevice* d = self.get()
        with nogil:
            d.set_access(ptr, n)

    def host_alloc(self, size):
        """cuMemHostAlloc: pinned host memory; returns its address as an int."""
        cdef size_t n = parse_size(size)
        cdef CDevice* d = self.get()
        with nogil:
            p = d.host_alloc(n)
        return <uintptr_t>p

    def host_free(self, uintptr_t ptr):
        """cuMemFreeHost."""
        cdef CDevice* d = self.get()
        with nogil:
            d.host_free(<void*>ptr)

    def create_stream(self):
        cdef CDevice* d = self.get()
        cdef uintptr_t s
        with nogil:
            s = d.create_stream()
        return s

    def destroy_stream(self, stream):
        cdef CDevice* d = self.get()
        cdef uintptr_t s = stream_handle(stream)
        with nogil:
            d.destroy_stream(s)

    def create_event(self):
        cdef CDevice* d = self.get()
        cdef uintptr_t e
        with nogil:
            e = d.create_event()
        return e

    def destroy_event(self, uintptr_t event):
        cdef CDevice* d = self.get()
        with nogil:
            d.destroy_event(event)

    def record_event(self, uintptr_t event, stream=0):
        cdef CDevice* d = self.get()
        cdef uintptr_t s = stream_handle(stream)
        with nogil:
            d.record_event(event, s)

    def query_event(self, uintptr_t event):
        cdef CDevice* d = self.get()
        cdef bool done
        with nogil:
            done = d.query_event(event)
        return done

    def synchronize_event(self, uintptr_t event):
        cdef CDevice* d = self.get()
        with nogil:
            d.synchronize_event(event)

    def wait_event(self, stream, uintptr_t event):
        cdef CDevice* d = self.get()
        cdef uintptr_t s = stream_handle(stream)
        with nogil:
            d.wait_event(s, event)

    def synchronize_stream(self, stream=0):
        cdef uintptr_t s = stream_handle(stream)
        cdef CDevice* d = self.get()
        with nogil:
            d.synchronize_stream(s)

    def synchronize(self):
        cdef CDevice* d = self.get()
        with nogil:
            d.synchronize()

    def copy_to_device(self, uintptr_t dst, uintptr_t src, nbytes, stream=0):
        """cuMemcpyHtoDAsync from host address ``src`` (keep it alive until done)."""
        cdef size_t n = parse_size(nbytes, "nbytes")
        cdef uintptr_t s = stream_handle(stream)
        cdef CDevice* d = self.get()
        with nogil:  # a pageable source makes the call wait for the copy
            d.copy_to_device(dst, <const void*>src, n, s)

    def copy_to_host(self, uintptr_t dst, uintptr_t src, nbytes, stream=0):
        """cuMemcpyDtoHAsync to host address ``dst`` (keep it alive until done)."""
        cdef size_t n = parse_size(nbytes, "nbytes")
        cdef uintptr_t s = stream_handle(stream)
        cdef CDevice* d = self.get()
        with nogil:  # a pageable destination makes the call wait for the copy
            d.copy_to_host(<void*>dst, src, n, s)

    def copy_device(self, uintptr_t dst, uintptr_t src, nbytes, stream=0):
        """cuMemcpyDtoDAsync."""
        cdef size_t n = parse_size(nbytes, "nbytes")
        cdef uintptr_t s = stream_handle(stream)
        cdef CDevice* d = self.get()
        with nogil:
            d.copy_device(dst, src, n, s)

    def __repr__(self):
        if not self.c_device:
            return f"<{type(self).__name__} (uninitialized)>"
        cap = self.capacity
        return (f"<{type(self).__name__} {self.name} granularity={self.granularity} "
                f"capacity={'unlimited' if cap is None else cap}>")
