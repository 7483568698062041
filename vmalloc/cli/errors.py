"""The command line's words for errors: which exceptions are the user's input (one line, exit
2), library messages rephrased with the flags, and each command's name for its messages."""

import os
import re

from vmalloc.errors import VmallocError

__all__ = ["CliError", "flag_for", "in_cli_terms", "prog", "user_errors"]


class CliError(Exception):
    """A user error already phrased for the command line."""


def flag_for(path, device):
    ordinal = device.split(":")[1] if device.startswith("cuda:") else device
    return f"--device {os.path.basename(path)}={ordinal}"


def user_errors():
    """The exception types that are the user's input, not a bug: one line, exit 2."""
    errors = [VmallocError, OSError, CliError]
    try:
        from vmalloc.offload.cli import OffloadCliError

        errors.append(OffloadCliError)
    except ImportError:
        pass
    try:
        from vmalloc.traces import TraceFormatError

        errors.append(TraceFormatError)
    except ImportError:
        pass
    return tuple(errors)


#: The library's words for its arguments -> the command line's flags (regex, replacement).
_FLAG_WORDS = (
    (r"pass format= one of", "pass --format, one of"),
    (r"\b(format|device|before_window)=", lambda m: "--" + m.group(1).replace("_", "-")),
    (r"^\w*Allocator: (chunk_size|max_split_size|remap_slack|policy)\b",
     lambda m: "--" + m.group(1).replace("_", "-")),
    (r"^HostDevice (granularity|capacity)\b", r"--\1"),
    (r"^(scale|seed|capacity|granularity) must\b", r"--\1 must"),
    (r"\(None for unlimited\)", ""),
)


def in_cli_terms(error, message):
    """A library error rephrased with the command line's flags (a device choice gets the
    --device that picks one)."""
    from vmalloc.traces._fields import NoDeviceEventsError, _listed

    for words, flag in _FLAG_WORDS:
        message = re.sub(words, flag, message)
    message = message.replace("  ", " ").replace(" ,", ",")
    if not isinstance(error, NoDeviceEventsError) or not error.path:
        return message
    gpus = [d for d in error.found if d.startswith("cuda")]
    hint = flag_for(error.path, (gpus or error.found or ["0"])[0])
    if error.wanted == "auto" and len(gpus) > 1:
        return (f"{error.path}: memory events for several GPU devices ({_listed(gpus)}): "
                f"choose one with {hint}, or --device all")
    return f"{message} (choose with {hint})"


_OFFLOAD_COMMANDS = ("simulate", "table", "train", "models", "gpus")


def prog(argv):
    """The command's name for its messages, as argparse names it in usage errors:
    ``vmalloc replay``, ``vmalloc offload simulate`` (one prefix per command)."""
    words = ["vmalloc"]
    if argv and argv[0] in ("replay", "stress", "bench", "convert", "offload"):
        words.append(argv[0])
        if argv[0] == "offload" and len(argv) > 1 and argv[1] in _OFFLOAD_COMMANDS:
            words.append(argv[1])
    return " ".join(words)
