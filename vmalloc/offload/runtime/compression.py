"""Compressed swaps (opt-in, never the default; IBM LMS's HalfComp): a float32 activation
is swapped out as fp16 or bf16, so half its bytes cross the link, and cast back to float32 when
it is swapped in. Lossy by design: a buffer whose swap-out was compressed reads the cast-back
values afterwards.

Which swap-outs are compressed: only with ``Runtime(compress="fp16" | "bf16")``, only transient
buffers the driver marked as activations (``allocate(..., kind="activation")``, ``adopt``'s,
``set_kind``; the default ``"unknown"`` never is: safe by construction, a parameter, a
gradient or optimizer state is only compressed if a driver wrongly calls it an activation),
that the driver said are float32 (``allocate(..., dtype=)``, ``adopt(..., dtype=)``,
``note_dtype``; a buffer seen as several dtypes never is) and, while a schedule is followed,
only the variables in its ``compressed`` set (those that were still activations when the
recorded iteration ended). Persistent buffers are never compressed.

How: the runtime asks its swap backend for ``swap_out_compressed(ptr, nbytes, fmt, stream)``;
the swap-in is the backend's ordinary ``swap_in`` (it knows the key is compressed) and the
cast back happens when that copy is waited. The PyTorch backends cast with PyTorch on the copy
side; over the :class:`~vmalloc.offload.SwapManager` on the emulated device,
:class:`~vmalloc.offload.runtime.compressing_swap.CompressingSwap` casts in place with NumPy
and copies the half.
"""

from __future__ import annotations

from vmalloc.errors import InvalidArgumentError

#: Compressed formats the runtime executes (as vmalloc.offload.scheduling.recompute.COMPRESSIONS).
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


def __getattr__(name):
    # CompressingSwap lives in its own module (it imports this one's casts).
    if name == "CompressingSwap":
        from vmalloc.offload.runtime.compressing_swap import CompressingSwap
        return CompressingSwap
    raise AttributeError(name)


#: What a buffer holds, as its driver says (``Buffer.kind``). Only an ``"activation"`` (a
#: transient the program writes once and reads back within the iteration) may be compressed;
#: ``"unknown"`` (the default) never is.
KINDS = ("unknown", "activation", "gradient", "parameter", "state", "input")


def check_kind(kind):
    if kind not in KINDS:
        raise InvalidArgumentError(f"kind must be one of {KINDS}, got {kind!r}")


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
            from vmalloc.offload.swap import SwapManager
            if not isinstance(self.swap, SwapManager):
                raise InvalidArgumentError(
                    f"compress={compress!r}: the swap backend {type(self.swap).__name__} cannot "
                    "compress (it has no swap_out_compressed)")
            from vmalloc.offload.runtime.compressing_swap import CompressingSwap
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

    def set_kind(self, buf, kind) -> None:
        """What ``buf`` holds (:data:`KINDS`), as the driver knows it: only a float32
        ``"activation"`` may be compressed. A driver marks an activation when it creates one,
        and takes the mark back (``"gradient"``, ``"state"``...) as soon as it learns better:
        the schedule compresses only what was still an activation when its iteration ended."""
        self._check_buffer(buf, "set_kind")
        check_kind(kind)
        buf.kind = kind

    def _compressible(self, buf):
        return (buf.kind == "activation" and not buf.persistent and buf.dtype == "float32"
                and buf.movable and buf.nbytes % 4 == 0)

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
        """The recorded schedule's ``compressed`` set: its float32 activations (a scheduler's
        own set is checked: only float32 transient activations can be compressed)."""
        sched = self._schedule
        if self.compress is None or sched is None:
            return
        dtypes = {self._transient_vars[k]: b for k, b in enumerate(self._record_allocs)}
        if sched.compressed:
            bad = sorted(v for v in sched.compressed
                         if v not in dtypes or not self._compressible(dtypes[v]))
            if bad:
                self._schedule = None
                names = ", ".join(
                    f"{self._sequence.variables[v].name} ("
                    f"{f'{dtypes[v].dtype} {dtypes[v].kind}' if v in dtypes else 'persistent'})"
                    for v in bad[:5])
                raise InvalidArgumentError(
                    f"the schedule compresses {len(bad)} variable(s) that are not float32 "
                    f"transient activations: {names}; only those can be swapped as "
                    f"{self.compress}")
        else:
            sched.compressed = frozenset(v for v, b in dtypes.items() if self._compressible(b))
        sched.compression = self.compress

    # --- the primitive, wrapped ------------------------------------------------------------
    def _out(self, buf):
        fmt = self._compress_format(buf)
        try:
            if fmt is None:
                return super()._out(buf)
            buf.key = self.swap.swap_out_compressed(buf.ptr, buf.nbytes, fmt,
                                                    stream=self.stream)
        except BaseException:
            self._follow_failed_out(buf)
            raise
        buf.where = "swapping_out"

    def _follow_failed_out(self, buf):
        """A failed swap-out whose own rollback failed may leave the buffer not resident in
        the backend (CompressingSwap: swapping in, its cast back pending; the poison backend:
        on the host): the runtime follows the backend, so the buffer's next use restores it."""
        try:
            state = self.swap.state(buf.ptr)
        except Exception:   # noqa: BLE001 - the swap-out's error is the one raised
            return
        if state in ("swapping_out", "on_host", "swapping_in") and buf.where == "resident":
            buf.key, buf.where = buf.ptr, state
            if state == "on_host":
                self._untrack(buf)

    def _compression_stats(self, swap):
        """compressed_swap_outs / _ins (the backend's counts) and compression (the format)."""
        out = {k: swap.get(k, 0) for k in COMPRESSION_STATS if k in swap}
        out.setdefault("compressed_swap_outs", 0)
        out.setdefault("compressed_swap_ins", 0)
        out["compression"] = self.compress
        return out
