"""Byte sizes written as ints or strings: ``4096``, ``"2MiB"``, ``"40MB"``, ``"1.5GiB"``."""

import re

from vmalloc.errors import InvalidArgumentError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

#: Largest size vmalloc accepts (2**56 bytes, 64 PiB): larger ones overflow chunk arithmetic.
MAX_SIZE = 1 << 56


def parse_size(value, what="size", allow_none=False):
    """Returns ``value`` in bytes as an int.

    Accepts a non-negative int, or a string of a number and an optional unit: B, kB/MB/GB/TB/PB
    (powers of 1000; K, M, G, T, P too) or KiB/MiB/GiB/TiB/PiB (powers of 1024), in any case.
    A fractional result must be a whole number of bytes ("1.5KiB" is 1536; "0.3B" is an error).
    Raises InvalidArgumentError naming ``what`` for anything else.
    """
    if type(value) is int and 0 <= value <= MAX_SIZE:
        return value        # (the common case first: every device read and write comes here)
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be a number of bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidArgumentError(
                f"{what} {value!r} is not a size: write bytes as an int or a string such as "
                "'2MiB', '40MB', '1.5GiB'")
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
        if "." in number:
            whole, _, frac = number.partition(".")
            scaled = int(whole or "0") * unit * 10 ** len(frac) + int(frac or "0") * unit
            n, rest = divmod(scaled, 10 ** len(frac))
            if rest:
                raise InvalidArgumentError(f"{what} {value!r} is not a whole number of bytes")
        else:
            n = int(number) * unit
    else:
        try:
            n = int(value.__index__())
        except (AttributeError, TypeError):
            raise InvalidArgumentError(
                f"{what} must be an int or a string such as '2MiB', got {type(value).__name__}"
            ) from None
    if n < 0:
        raise InvalidArgumentError(f"{what} must not be negative, got {n}")
    if n > MAX_SIZE:
        raise InvalidArgumentError(f"{what} {n} is larger than vmalloc's limit of 2**56 bytes")
    return n


def parse_optional_size(value, what, none_means):
    """``value`` in bytes, which must be positive, or 0 for ``None``: the C++ options' "not
    set" (the default, or no limit; ``none_means`` says which, for the message).

    Raises InvalidArgumentError for 0 (which would silently mean "not set") and for anything
    :func:`parse_size` refuses.
    """
    if value is None:
        return 0
    n = parse_size(value, what)
    if n == 0:
        raise InvalidArgumentError(f"{what} must be positive (None for {none_means}), got 0")
    return n


def size_argument(text):
    """:func:`parse_size` as an argparse ``type=``: a bad size becomes argparse's one-line
    usage error."""
    import argparse

    try:
        return parse_size(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_size_argument(text):
    """A positive :func:`parse_size` as an argparse ``type=`` (0 would mean "not set")."""
    import argparse

    n = size_argument(text)
    if n == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive size such as '2MiB'")
    return n


#: The granularity of the emulated devices of the command line (as current GPUs).
DEFAULT_GRANULARITY = 2 << 20


def chunk_size_problem(chunk_size, granularity=None):
    """Why ``chunk_size`` bytes cannot be a virtual allocator's chunk on a device of
    ``granularity`` bytes (default 2 MiB), or None when it can.

    The rule the allocator enforces (``resolve_chunk_size`` in C++): a positive multiple of
    the device granularity. The command line checks it here, once, before any work, so that
    every command refuses the same sizes with the same words.
    """
    g = DEFAULT_GRANULARITY if granularity is None else granularity
    if chunk_size is None:
        return None
    if chunk_size <= 0 or g <= 0 or chunk_size % g:
        low, high = chunk_size // g * g if g > 0 else 0, -(-chunk_size // g) * g if g > 0 else 0
        near = " or ".join(_compact(n) for n in dict.fromkeys((low, high)) if n > 0)
        return (f"{format_size(chunk_size)} is not a multiple of the device granularity "
                f"({format_size(g)})" + (f": use {near}" if near else ""))
    return None


def _compact(nbytes):
    """``4194304`` -> ``"4MiB"``: a size as the command line accepts it back."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def size_list_argument(text):
    """A comma-separated list of positive sizes (``"4KiB,3MiB"``) as an argparse ``type=``."""
    import argparse

    try:
        sizes = [parse_size(part.strip(), "size") for part in text.split(",") if part.strip()]
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not sizes or 0 in sizes:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive sizes such as "
                                         "'4KiB,3MiB'")
    return sizes


def format_size(nbytes, exact=False):
    """``2097152`` -> ``"2.00 MiB"``, ``512`` -> ``"512 B"``: the package's one byte formatter,
    for tables and messages. Binary units up to PiB, two decimals above bytes; with ``exact``
    a rounded figure is followed by the count (``"2.00 MiB (2097152 bytes)"``).

    The C++ side writes sizes alike (``vmalloc::detail::human_bytes``, in the library's
    messages and ``Stats`` summaries); tests/alloc/test_byte_format.py holds the two together.
    """
    unit, scale = binary_unit(nbytes)
    if scale == 1:
        return f"{int(nbytes)} B"
    text = f"{float(nbytes) / scale:.2f} {unit}"
    return f"{text} ({int(nbytes)} bytes)" if exact else text


def binary_unit(nbytes):
    """The unit :func:`format_size` writes ``nbytes`` in, and its bytes: ``(2 << 20)`` ->
    ``("MiB", 1048576)``. For a plot's axis, so that it reads as the sizes printed beside it."""
    value, scale = abs(float(nbytes)), 1
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 * scale:
            return unit, scale
        scale *= 1024
    return "PiB", scale
