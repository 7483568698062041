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


#: The device choice that lets the trace decide: its only GPU device.
AUTO = "auto"


def parse_device(device):
    """``device`` -> ``(kind, index)``: ``0`` or ``"cuda:0"`` -> ``("cuda", 0)``, ``"cpu"``
    -> ``("cpu", None)``, ``"cuda"`` -> ``("cuda", 0)``, ``"auto"`` or None -> ``("auto",
    None)`` (the reader picks the trace's only GPU device)."""
    if device is None or (isinstance(device, str) and device.strip().lower() == AUTO):
        return AUTO, None
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
        f"device must be 'auto', a CUDA ordinal (0), 'cuda:N' or 'cpu', got {device!r}"
    )


def device_name(kind, index):
    """``("cuda", 0)`` -> ``"cuda:0"``, ``("cpu", None)`` -> ``"cpu"``."""
    return kind if index is None else f"{kind}:{index}"


def only_gpu_device(devices, path):
    """The one GPU device name among ``devices`` (``{name: events}``), for device "auto";
    NoDeviceEventsError when there is none or several."""
    gpus = [d for d in devices if d.startswith("cuda")]
    if len(gpus) == 1:
        return gpus[0]
    raise NoDeviceEventsError(AUTO, list(devices), path)


class NoDeviceEventsError(TraceFormatError):
    """The trace has no memory events for the device asked for (``wanted``: a device name,
    or ``"auto"`` when it has no GPU device or several); ``found`` lists those it has. The
    command line rephrases it with its own flags."""

    def __init__(self, wanted, found, path):
        self.wanted = wanted
        self.found = list(found)
        listed = _listed(self.found) or "no device"
        if wanted == AUTO:
            gpus = [d for d in self.found if d.startswith("cuda")]
            if gpus:
                message = (f"the trace has memory events for several GPU devices "
                           f"({_listed(gpus)}): choose one")
            else:
                message = f"the trace has no GPU memory events, only events for {listed}"
        else:
            message = f"no memory events for device {wanted}; the trace has events for {listed}"
        super().__init__(message, path)


def _listed(names, most=8):
    names = list(names)
    if len(names) <= most:
        return ", ".join(names)
    return ", ".join(names[:most]) + f", ... ({len(names)} in all)"
