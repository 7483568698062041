"""The compressed swaps of the :class:`~vmalloc.offload.SwapManager` on the emulated device
(:class:`CompressingSwap`), used by :mod:`vmalloc.offload.runtime.compression`.

Failures lose nothing: every step that can fail (the host allocation, the cast, a copy, a
stream synchronization, mapping or unmapping the allocation's memory) either leaves the
allocation as it was before the call (the bytes a failed swap-out had cast in place are cast
back: the float32 values read their fp16 / bf16 round trip, what the swap would have made of
them anyway) or keeps the host copy, so that calling again completes the swap. The host copy is
freed only once the copy that restores the allocation has completed and been cast back. A host
block whose ``host_free`` failed is kept and freed again at the next call.
"""

from __future__ import annotations

from vmalloc.errors import InvalidArgumentError, OutOfMemoryError
from vmalloc.offload.runtime.compression import FORMATS, from_half_bits, to_half_bits


class _Memory:
    """``count`` elements of ``typestr`` at ``ptr``, as NumPy reads them (a device address is a
    host address on the emulated device). Not a ctypes array: ``c_float * count`` makes a
    class per size, and every class is a reference cycle of its own, left to the collector."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr, count, typestr):
        self.__array_interface__ = dict(data=(ptr, False), shape=(count,), typestr=typestr,
                                        version=3)


def _array(ptr, count, dtype):
    import numpy as np
    return np.asarray(_Memory(ptr, count, np.dtype(dtype).str))    # (native byte order)


class _Copy:
    """One compressed host copy: of the float32 allocation at ``ptr`` (``nbytes``)."""

    __slots__ = ("ptr", "nbytes", "fmt", "stable", "state", "host", "held", "recopy")

    def __init__(self, ptr, nbytes, fmt, stable, host):
        self.ptr, self.nbytes, self.fmt, self.stable, self.host = ptr, nbytes, fmt, stable, host
        self.state = "swapping_out"   # -> on_host -> swapping_in -> (gone)
        self.held = None      # on_host: device memory already taken back (a failed undo)
        self.recopy = False   # swapping_in: the copy must be issued again before the cast

    @property
    def half(self):
        return self.nbytes // 4 * 2


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
    The compressed copies' pinned bytes count against the manager's ``host_capacity``, in both
    directions (a lossless swap-out sees them too).
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
        self._d2h = self._h2d = None
        self._d2h = device.create_stream()
        self._h2d = device.create_stream()
        self._out = {}        # key (the host copy's address) -> _Copy, out
        self._in = {}         # ptr -> _Copy, swapping in
        self._orphans = []    # host blocks whose host_free failed: freed at the next call
        self._counts = dict(compressed_swap_outs=0, compressed_swap_ins=0,
                            compressed_bytes_out=0, compressed_bytes_in=0)

    def __getattr__(self, name):
        if name.startswith("_") or name == "manager":
            raise AttributeError(name)      # (never the manager's private state)
        return getattr(self.manager, name)

    # --- pinned host memory ---------------------------------------------------------------
    def _host_bytes(self):
        return sum(c.half for c in self._out.values()) + sum(
            c.half for c in self._in.values() if c.host is not None)

    def _room(self, nbytes):
        """Raises OutOfMemoryError (before any driver call) if ``nbytes`` more pinned bytes
        would exceed host_capacity, with the compressed copies counted."""
        s = self.manager.stats()
        cap = s.get("host_capacity_bytes", 0)
        if not cap or cap >= 1 << 62:
            return
        held = s["host_bytes_in_use"] + s["host_bytes_cached"] + self._host_bytes()
        if held + nbytes > cap:
            self.manager.release_cached_host()
            s = self.manager.stats()
            held = s["host_bytes_in_use"] + s["host_bytes_cached"] + self._host_bytes()
        if held + nbytes > cap:
            raise OutOfMemoryError(
                f"host: a swap-out of {nbytes} bytes exceeds host_capacity {cap} bytes "
                f"({held} bytes of pinned host memory in use, {self._host_bytes()} of them "
                "compressed copies)", requested_bytes=nbytes)

    def _free_host(self, host):
        try:
            self.device.host_free(host)
        except Exception:   # noqa: BLE001 - kept, freed again at the next call
            self._orphans.append(host)

    def _flush(self):
        while self._orphans:
            host = self._orphans.pop()
            try:
                self.device.host_free(host)
            except Exception:
                self._orphans.append(host)
                raise

    # --- swap-out ---------------------------------------------------------------------------
    def swap_out(self, ptr, stream=0):
        """The manager's (lossless) swap-out, with the compressed copies' pinned bytes counted
        against host_capacity."""
        self._flush()
        if self._out or self._in:
            self._room(self.allocator.allocation_size(ptr))
        return self.manager.swap_out(ptr, stream=stream)

    def swap_out_compressed(self, ptr, nbytes, fmt, stream=0):
        """Starts a compressed swap-out of the float32 allocation at ``ptr`` (after the work
        queued on ``stream``); returns its key. A failure leaves it resident (its values cast
        back if the cast had happened) and frees the host copy."""
        if fmt not in FORMATS:
            raise InvalidArgumentError(f"unknown compression {fmt!r}; choose from {FORMATS}")
        if nbytes % 4:
            raise InvalidArgumentError(f"a float32 allocation has a multiple of 4 bytes, not "
                                       f"{nbytes}")
        if self.manager.state(ptr) != "resident":
            raise InvalidArgumentError(f"swap_out: {ptr:#x} is {self.manager.state(ptr)}")
        self._flush()
        count = nbytes // 4
        self._room(count * 2)
        stable = not self.manager.relocates(ptr)
        host = self.device.host_alloc(max(count * 2, 1))
        cast = False
        try:
            # The cast reads what the program wrote: after the compute stream's work.
            self.device.synchronize_stream(stream)
            bits = to_half_bits(_array(ptr, count, "float32"), fmt)
            _array(ptr, count, "uint16")[...] = bits
            cast = True
            self.device.copy_to_host(host, ptr, count * 2, stream=self._d2h)
        except BaseException as first:
            self._free_host(host)
            if cast:    # the allocation holds the half: float32 again (the round trip)
                try:
                    self._cast_back(ptr, count, fmt)
                except BaseException:
                    # The half is still in place: the allocation is "swapping_in" with nothing
                    # to copy, and its wait casts it back (the first error is the one raised).
                    c = _Copy(ptr, nbytes, fmt, stable, None)
                    c.state = "swapping_in"
                    self._in[ptr] = c
                raise first
            raise
        self._out[host] = _Copy(ptr, nbytes, fmt, stable, host)
        self._counts["compressed_swap_outs"] += 1
        self._counts["compressed_bytes_out"] += count * 2
        return host

    @staticmethod
    def _cast_back(ptr, count, fmt):
        bits = _array(ptr, count, "uint16").copy()
        _array(ptr, count, "float32")[...] = from_half_bits(bits, fmt)

    def compressed(self, key):
        """Whether ``key`` names a compressed copy (out, or in flight back)."""
        return key in self._out or key in self._in

    def state(self, key):
        c = self._in.get(key) or self._out.get(key)
        return c.state if c is not None else self.manager.state(key)

    def _release(self, c):
        """A swap-out's copy is done: the float32 allocation's memory goes (a failure leaves
        it swapping out, to be waited again)."""
        self.device.synchronize_stream(self._d2h)
        if c.stable:
            self.allocator.unmap_backing(c.ptr, stream=self._d2h)
        else:
            self.manager.deallocate(c.ptr)
        c.state = "on_host"

    # --- swap-in ----------------------------------------------------------------------------
    def swap_in(self, key, stream=0):
        c = self._out.get(key)
        if c is None:
            return self.manager.swap_in(key, stream=stream)
        self._flush()
        if c.state == "swapping_out":
            # Cancelled: the memory (holding the half) was never released; the copy must be
            # done before the host block may go (at the wait).
            self.device.synchronize_stream(self._d2h)
            c.recopy = False
            ptr = c.ptr
        else:
            ptr = c.held
            if ptr is None:
                # Memory first: an OutOfMemoryError leaves the copy on the host, unchanged.
                if c.stable:
                    self.allocator.map_backing(c.ptr, stream=stream)
                    ptr = c.ptr
                else:
                    ptr = self.manager.allocate(c.nbytes, stream=stream)
            try:
                self.device.copy_to_device(ptr, c.host, c.half, stream=self._h2d)
            except BaseException:
                self._give_back(c, ptr)
                raise
            c.held = None
            self._counts["compressed_bytes_in"] += c.half
        del self._out[key]
        c.ptr, c.state = ptr, "swapping_in"
        self._in[ptr] = c
        return ptr

    def _give_back(self, c, ptr):
        """A failed swap-in copy: the memory taken for it goes back (kept for the next
        swap-in if that fails too); the copy stays on the host."""
        try:
            if c.stable:
                self.allocator.unmap_backing(ptr, stream=self._h2d)
            else:
                self.manager.deallocate(ptr)
            c.held = None
        except Exception:   # noqa: BLE001 - the first error is the one raised
            c.held = ptr

    def wait(self, key, stream=0):
        c = self._out.get(key)
        if c is not None:
            if c.state == "swapping_out":
                self._release(c)
            return
        c = self._in.get(key)
        if c is None:
            return self.manager.wait(key, stream=stream)
        self._flush()
        count = c.nbytes // 4
        if c.recopy:    # an earlier wait failed: the copy may not have completed
            self.device.copy_to_device(c.ptr, c.host, c.half, stream=self._h2d)
            c.recopy = False
        c.recopy = c.host is not None
        self.device.synchronize_stream(self._h2d)
        self._cast_back(c.ptr, count, c.fmt)
        # Restored: only now may the host copy go.
        del self._in[key]
        if c.host is not None:
            self._free_host(c.host)
            self._counts["compressed_swap_ins"] += 1

    # --- frees ----------------------------------------------------------------------------
    def deallocate(self, ptr, stream=0, nbytes=None):
        c = self._out.get(ptr)
        if c is None:
            if ptr in self._in:
                self.wait(ptr, stream=stream)
            return self.manager.deallocate(ptr, stream=stream, nbytes=nbytes)
        self._flush()
        if c.state == "swapping_out":
            self.device.synchronize_stream(self._d2h)
        if c.stable or c.state == "swapping_out":
            self.manager.deallocate(c.ptr, stream=stream)   # (unbacked, or never released)
        elif c.held is not None:
            self.manager.deallocate(c.held, stream=stream)
        del self._out[ptr]
        self._free_host(ptr)

    def discard(self, key):
        c = self._out.get(key)
        if c is not None:
            # The owner frees the float32 allocation; only the host copy is the backend's.
            self._flush()
            if c.state == "swapping_out":
                self.device.synchronize_stream(self._d2h)
            if c.held is not None and not c.stable:
                self.manager.deallocate(c.held)
            elif c.held is not None:
                c.held = None    # (mapped again: the owner frees it with its memory)
            del self._out[key]
            self._free_host(key)
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
        out["compressed_host_bytes"] = self._host_bytes()
        out["compressed_orphans"] = len(self._orphans)
        return out

    def __del__(self):
        try:
            for c in list(self._out.values()) + list(self._in.values()):
                self.device.synchronize_stream(self._d2h)
                self.device.synchronize_stream(self._h2d)
                if c.host is not None:
                    self.device.host_free(c.host)
            for host in self._orphans:
                self.device.host_free(host)
            self.device.destroy_stream(self._d2h)
            self.device.destroy_stream(self._h2d)
        except Exception:   # pragma: no cover - interpreter shutdown, a failed __init__
            pass
