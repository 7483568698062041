"""Compressed swaps (opt-in, never the default; IBM LMS's HalfComp): a float32 transient buffer
is swapped out as fp16 or bf16, so half its bytes cross the link, and cast back to float32 when
it is swapped in. Lossy by design: a buffer whose swap-out was compressed reads the cast-back
values afterwards.

Which swap-outs are compressed: only with ``Runtime(compress="fp16" | "bf16")``, only transient
buffers the driver said are float32 (``allocate(..., dtype=)``, ``adopt(..., dtype=)``,
``note_dtype``; a buffer seen as several dtypes never is) and, while a schedule is followed,
only the variables in its ``compressed`` set (filled from those dtypes when the iteration is
recorded). Persistent buffers (parameters, optimizer state) are never compressed.

How: the runtime asks its swap backend for ``swap_out_compressed(ptr, nbytes, fmt, stream)``;
the swap-in is the backend's ordinary ``swap_in`` (it knows the key is compressed) and the
cast back happens when that copy is waited. The PyTorch backends cast with PyTorch on the copy
side; over the :class:`~vmalloc.offload.SwapManager` on the emulated device,
:class:`CompressingSwap` (below) casts in place with NumPy and copies the half.
"""

from __future__ import annotations

import ctypes

from vmalloc.errors import InvalidArgumentError

#: Compressed formats the runtime executes (as vmalloc.offload.recompute.COMPRESSIONS).
FORMATS = ("fp16", "bf16")

#: The counters :meth:`Runtime.stats` adds for compression.
COMPRESSION_STATS = ("compressed_swap_outs", "compressed_swap_ins")


def dtype_name(dtype):
    """``"float32"`` for float32 however spelled (NumPy, PyTorch, a string), None for None."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype.split(".")[-1]
    name = getattr(dtype, "name", None)   # NumPy dtypes and scalar types
    if isinstance(name, str) and not str(dtype).startswith("torch."):
        return name
    try:
        import numpy as np
        if isinstance(dtype, type) and issubclass(dtype, np.generic):
            return np.dtype(dtype).name
    except ImportError:  # pragma: no cover - NumPy is a dependency
        pass
    return str(dtype).split(".")[-1]      # torch.float32 -> float32


# --- the casts, in NumPy --------------------------------------------------------------------
def to_half_bits(a, fmt):
    """float32 array -> uint16 array of fp16 or bf16 bits, rounded to nearest even."""
    import numpy as np

    if fmt == "fp16":
        with np.errstate(over="ignore"):    # beyond fp16's range: inf (the user opted in)
            return a.astype(np.float16).view(np.uint16)
    u = a.view(np.uint32)
    # bf16 is float32's upper half: add half an ulp of it (less one when the kept bit is even,
    # so ties go to even), then truncate. A NaN stays a (quiet) NaN.
    out = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
           >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def from_half_bits(bits, fmt):
    """uint16 array of fp16 or bf16 bits -> float32 array (exact)."""
    import numpy as np

    if fmt == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_trip(a, fmt):
    """What a compressed swap makes of float32 ``a``."""
    return from_half_bits(to_half_bits(a, fmt), fmt)


def _array(ptr, count, ctype):
    import numpy as np
    return np.ctypeslib.as_array((ctype * count).from_address(ptr))


class CompressingSwap:
    """A :class:`~vmalloc.offload.SwapManager` over an allocator of a backed
    :class:`vmalloc.HostDevice`, that also swaps float32 allocations compressed.

    A compressed swap-out casts the float32 allocation to fp16 / bf16 *in place* (the first
    half of its bytes; NumPy is the emulated device's cast kernel: device addresses are host
    addresses there) and copies that half to pinned host memory on the backend's own copy
    stream; waiting for it releases the allocation's memory (``unmap_backing``: same address,
    for chunk-owning allocations of the virtual allocator; freed otherwise, and allocated anew
    on the way back). The swap-in maps the memory again and copies the half back; waiting for
    it casts back to float32 in place. So the link carries half the bytes, and the device
    holds exactly what a lossless swap would hold, when it would (no scratch buffer).
    Lossless swaps are the manager's; its counters include the compressed copies' bytes.
    """

    def __init__(self, manager, allocator):
        from vmalloc._core.host_device import HostDevice

        device = allocator.device
        if not isinstance(device, HostDevice) or not device.backed:
            raise InvalidArgumentError(
                f"compress with the SwapManager needs a backed HostDevice (the runtime casts "
                f"with NumPy on the emulated device); {device!r} is not one: use a backend "
                "that casts on its own device (vmalloc.torch.out_of_core's)")
        self.manager = manager
        self.allocator = allocator
        self.device = device
        self._d2h = device.create_stream()
        self._h2d = device.create_stream()
        # key (its pinned host copy's address) -> [ptr, nbytes, fmt, pointer-stable, state]
        self._out = {}
        self._in = {}     # ptr -> (host address, fmt, nbytes): swapping in
        self._counts = dict(compressed_swap_outs=0, compressed_swap_ins=0,
                            compressed_bytes_out=0, compressed_bytes_in=0)

    def __getattr__(self, name):
        if name.startswith("_") or name == "manager":
            raise AttributeError(name)      # (never the manager's private state)
        return getattr(self.manager, name)

    def swap_out_compressed(self, ptr, nbytes, fmt, stream=0):
        """Starts a compressed swap-out of the float32 allocation at ``ptr`` (after the work
        queued on ``stream``); returns its key."""
        if fmt not in FORMATS:
            raise InvalidArgumentError(f"unknown compression {fmt!r}; choose from {FORMATS}")
        if nbytes % 4:
            raise InvalidArgumentError(f"a float32 allocation has a multiple of 4 bytes, not "
                                       f"{nbytes}")
        if self.manager.state(ptr) != "resident":
            raise InvalidArgumentError(f"swap_out: {ptr:#x} is {self.manager.state(ptr)}")
        count = nbytes // 4
        stable = not self.manager.relocates(ptr)
        host = self.device.host_alloc(max(count * 2, 1))
        # The cast reads what the program wrote: after the compute stream's work.
        self.device.synchronize_stream(stream)
        bits = to_half_bits(_array(ptr, count, ctypes.c_float), fmt)
        _array(ptr, count, ctypes.c_uint16)[...] = bits
        self.device.copy_to_host(host, ptr, count * 2, stream=self._d2h)
        self._out[host] = [ptr, nbytes, fmt, stable, "swapping_out"]
        self._counts["compressed_swap_outs"] += 1
        self._counts["compressed_bytes_out"] += count * 2
        return host

    def compressed(self, key):
        """Whether ``key`` names a compressed copy (out, or in flight back)."""
        return key in self._out or key in self._in

    def state(self, key):
        if key in self._in:
            return "swapping_in"
        rec = self._out.get(key)
        return rec[4] if rec is not None else self.manager.state(key)

    def _release(self, rec):
        """A swap-out's copy is done: the float32 allocation's memory goes."""
        self.device.synchronize_stream(self._d2h)
        if rec[3]:
            self.allocator.unmap_backing(rec[0], stream=self._d2h)
        else:
            self.manager.deallocate(rec[0])
        rec[4] = "on_host"

    def swap_in(self, key, stream=0):
        rec = self._out.get(key)
        if rec is None:
            return self.manager.swap_in(key, stream=stream)
        ptr, nbytes, fmt, stable, state = rec
        if state == "swapping_out":
            # Cancelled: the memory (holding the half) was never released.
            self.device.synchronize_stream(self._d2h)
        else:
            # Memory first: an OutOfMemoryError leaves the copy on the host, nothing changed.
            if stable:
                self.allocator.map_backing(ptr, stream=stream)
            else:
                ptr = self.manager.allocate(nbytes, stream=stream)
            self.device.copy_to_device(ptr, key, (nbytes // 4) * 2, stream=self._h2d)
            self._counts["compressed_bytes_in"] += (nbytes // 4) * 2
        del self._out[key]
        self._in[ptr] = (key, fmt, nbytes)
        return ptr

    def wait(self, key, stream=0):
        rec = self._out.get(key)
        if rec is not None:
            if rec[4] == "swapping_out":
                self._release(rec)
            return
        flight = self._in.pop(key, None)
        if flight is None:
            return self.manager.wait(key, stream=stream)
        host, fmt, nbytes = flight
        self.device.synchronize_stream(self._h2d)
        count = nbytes // 4
        bits = _array(key, count, ctypes.c_uint16).copy()
        _array(key, count, ctypes.c_float)[...] = from_half_bits(bits, fmt)
        self.device.host_free(host)
        self._counts["compressed_swap_ins"] += 1

    def deallocate(self, ptr, stream=0, nbytes=None):
        rec = self._out.pop(ptr, None)
        if rec is None:
            if ptr in self._in:
                self.wait(ptr, stream=stream)
            return self.manager.deallocate(ptr, stream=stream, nbytes=nbytes)
        self.device.synchronize_stream(self._d2h)
        self.device.host_free(ptr)
        if rec[3] or rec[4] == "swapping_out":
            self.manager.deallocate(rec[0], stream=stream)   # (unbacked, or never released)

    def discard(self, key):
        rec = self._out.pop(key, None)
        if rec is not None:
            # The owner frees the float32 allocation; only the host copy is the backend's.
            self.device.synchronize_stream(self._d2h)
            self.device.host_free(key)
            return True
        if key in self._in:
            self.wait(key)
        return self.manager.discard(key)

    def stats(self):
        out = self.manager.stats()
        c = self._counts
        out["bytes_swapped_out"] = out.get("bytes_swapped_out", 0) + c["compressed_bytes_out"]
        out["bytes_swapped_in"] = out.get("bytes_swapped_in", 0) + c["compressed_bytes_in"]
        out["swap_outs"] = out.get("swap_outs", 0) + c["compressed_swap_outs"]
        out["swap_ins"] = out.get("swap_ins", 0) + c["compressed_swap_ins"]
        out.update(c)
        # pinned host bytes the compressed copies hold now (beside the manager's pool)
        out["compressed_host_bytes"] = sum(r[1] // 4 * 2 for r in self._out.values()) + sum(
            f[2] // 4 * 2 for f in self._in.values())
        return out

    def __del__(self):
        try:
            for key in list(self._out):
                self.device.synchronize_stream(self._d2h)
                self.device.host_free(key)
            for host, _, _ in self._in.values():
                self.device.synchronize_stream(self._h2d)
                self.device.host_free(host)
            self.device.destroy_stream(self._d2h)
            self.device.destroy_stream(self._h2d)
        except Exception:   # pragma: no cover - interpreter shutdown, a failed __init__
            pass


class Compression:
    """The compression half of :class:`~vmalloc.offload.Runtime` (a mixin, before
    ``Residency``: it wraps the swap-out primitive; the backend casts back on its swap-in)."""

    def _init_compression(self, compress):
        if compress is not None and compress not in FORMATS:
            raise InvalidArgumentError(f"compress must be None, 'fp16' or 'bf16', got "
                                       f"{compress!r}")
        self.compress = compress
        if compress is None:
            return
        if not hasattr(self.swap, "swap_out_compressed"):
            from vmalloc.offload import SwapManager
            if not isinstance(self.swap, SwapManager):
                raise InvalidArgumentError(
                    f"compress={compress!r}: the swap backend {type(self.swap).__name__} cannot "
                    "compress (it has no swap_out_compressed)")
            self.swap = CompressingSwap(self.swap, self.allocator)

    # --- dtypes (driver protocol) ----------------------------------------------------------
    def note_dtype(self, buf, dtype) -> None:
        """The program also views ``buf`` as ``dtype``: a buffer seen as several dtypes is
        never compressed (``buf.dtype`` becomes ``"mixed"``)."""
        self._check_buffer(buf, "note_dtype")
        name = dtype_name(dtype)
        if name is None or buf.dtype == name:
            return
        buf.dtype = name if buf.dtype is None else "mixed"

    def _compressible(self, buf):
        return (not buf.persistent and buf.dtype == "float32" and buf.movable
                and buf.nbytes % 4 == 0)

    def _compress_format(self, buf):
        """The format buf's swap-out uses now (None: lossless)."""
        if self.compress is None or not self._compressible(buf):
            return None
        if self._following and self._schedule is not None:
            v = self._var_of_buf.get(buf.id)
            if v is None or v not in self._schedule.compressed:
                return None
        return self.compress

    def _plan_compression(self):
        """The recorded schedule's ``compressed`` set: its float32 transient variables (a
        scheduler's own set is checked: only float32 transient buffers can be compressed)."""
        sched = self._schedule
        if self.compress is None or sched is None:
            return
        dtypes = {self._transient_vars[k]: b for k, b in enumerate(self._record_allocs)}
        if sched.compressed:
            bad = sorted(v for v in sched.compressed
                         if v not in dtypes or not self._compressible(dtypes[v]))
            if bad:
                self._schedule = None
                names = ", ".join(f"{self._sequence.variables[v].name} "
                                  f"({dtypes[v].dtype if v in dtypes else 'persistent'})"
                                  for v in bad[:5])
                raise InvalidArgumentError(
                    f"the schedule compresses {len(bad)} variable(s) that are not float32 "
                    f"transient buffers: {names}; only those can be swapped as {self.compress}")
        else:
            sched.compressed = frozenset(v for v, b in dtypes.items() if self._compressible(b))
        sched.compression = self.compress

    # --- the primitive, wrapped ------------------------------------------------------------
    def _out(self, buf):
        fmt = self._compress_format(buf)
        if fmt is None:
            return super()._out(buf)
        buf.key = self.swap.swap_out_compressed(buf.ptr, buf.nbytes, fmt, stream=self.stream)
        buf.where = "swapping_out"

    def _compression_stats(self, swap):
        """compressed_swap_outs / _ins (the backend's counts) and compression (the format)."""
        out = {k: swap.get(k, 0) for k in COMPRESSION_STATS if k in swap}
        out.setdefault("compressed_swap_outs", 0)
        out.setdefault("compressed_swap_ins", 0)
        out["compression"] = self.compress
        return out
