"""Validation helpers shared by the readers: every bad value becomes a TraceFormatError that
names the file and the line or record."""

from vmalloc.errors import InvalidArgumentError, TraceFormatError

U64_MAX = (1 << 64) - 1


def u64(value, what, path, record):
    """``value`` as an int in [0, 2**64), else TraceFormatError naming ``what``."""
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise TraceFormatError(
            f"{what} must be an integer in [0, 2**64), got {value!r:.60}", path, record
        )
    return value


def parse_device(device):
    """``device`` -> ``(kind, index)``: ``0`` or ``"cuda:0"`` -> ``("cuda", 0)``, ``"cpu"``
    -> ``("cpu", None)``, ``"cuda"`` -> ``("cuda", 0)``."""
    if type(device) is int:
        if device < 0:
            raise InvalidArgumentError(f"device must be a CUDA ordinal >= 0, got {device}")
        return "cuda", device
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cpu":
            return "cpu", None
        if text == "cuda":
            return "cuda", 0
        if text.startswith("cuda:") and text[5:].isdigit():
            return "cuda", int(text[5:])
        if text.isdigit():
            return "cuda", int(text)
    raise InvalidArgumentError(
        f"device must be a CUDA ordinal (0), 'cuda:N' or 'cpu', got {device!r}"
    )


def device_name(kind, index):
    """``("cuda", 0)`` -> ``"cuda:0"``, ``("cpu", None)`` -> ``"cpu"``."""
    return kind if index is None else f"{kind}:{index}"
