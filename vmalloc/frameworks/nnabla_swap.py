"""nnabla's array casts as a swap backend of the :class:`~vmalloc.offload.Runtime` (as
PyTorch's poison and CUDA backends are): swap-out = ``cast(dtype, host_ctx)``, swap-in =
``cast(dtype, device_ctx)``. Used by :mod:`vmalloc.frameworks.nnabla`."""

from __future__ import annotations

from typing import Dict

from vmalloc.errors import InvalidArgumentError


def _nbytes(arr):
    try:
        import numpy as np
        return int(arr.size) * np.dtype(arr.dtype).itemsize
    except Exception:  # noqa: BLE001 - a cleared array may have no dtype: count 4 bytes
        return int(arr.size) * 4


def _has_content(arr) -> bool:
    """Whether the array holds data worth moving (not cleared, not a pending zero-fill)."""
    try:
        return not (arr.clear_called or arr.zeroing)
    except Exception:  # noqa: BLE001
        return False


class NnablaSwap:
    """nnabla's casts as a swap backend of the :class:`~vmalloc.offload.Runtime`: keys are
    ``hash(NdArray)``. A cast from Python is synchronous, so a swap is complete when issued;
    the states still pass through ``swapping_out`` / ``swapping_in`` as the runtime expects.
    An array without content (cleared, or a pending zero-fill) is not cast: nnabla has
    nothing to move."""

    def __init__(self, host_ctx, device_ctx):
        self.host_ctx = host_ctx
        self.device_ctx = device_ctx
        self._arrays: Dict[int, object] = {}
        self._state: Dict[int, str] = {}
        self._stats = dict(bytes_swapped_out=0, bytes_swapped_in=0, swap_outs=0, swap_ins=0)

    def register(self, key, arr):
        self._arrays[key] = arr

    def state(self, key):
        return self._state.get(key, "resident")

    def _cast(self, key, to_device):
        arr = self._arrays.get(key)
        if arr is None:
            raise InvalidArgumentError(f"no nnabla array is registered as {key:#x}")
        if not _has_content(arr):
            return
        arr.cast(arr.dtype, self.device_ctx if to_device else self.host_ctx)
        side = "in" if to_device else "out"
        self._stats[f"bytes_swapped_{side}"] += _nbytes(arr)
        self._stats[f"swap_{side}s"] += 1

    def swap_out(self, key, stream=0):
        if self.state(key) != "resident":
            raise InvalidArgumentError(f"swap_out: {key:#x} is {self.state(key)}")
        self._cast(key, False)
        self._state[key] = "swapping_out"
        return key

    def swap_in(self, key, stream=0):
        state = self.state(key)
        if state not in ("on_host", "swapping_out"):
            raise InvalidArgumentError(f"swap_in: {key:#x} is {state}")
        self._cast(key, True)
        if state == "swapping_out":
            del self._state[key]          # cancelled: nothing in flight
        else:
            self._state[key] = "swapping_in"
        return key

    def wait(self, key, stream=0):
        state = self.state(key)
        if state == "swapping_out":
            self._state[key] = "on_host"
        elif state == "swapping_in":
            del self._state[key]
        else:
            raise InvalidArgumentError(f"wait: {key:#x} has no copy in flight ({state})")

    def discard(self, key):
        """The program cleared the array: forget it (its memory is nnabla's)."""
        self._state.pop(key, None)
        self._arrays.pop(key, None)

    def allocate(self, nbytes, stream=0):
        raise InvalidArgumentError("nnabla allocates its arrays itself: the driver adopts them")

    def deallocate(self, key, stream=0):
        raise InvalidArgumentError("nnabla frees its arrays itself: the driver forgets them")

    def stats(self):
        return dict(self._stats)
