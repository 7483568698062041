"""The traces shipped with vmalloc (``vmalloc/traces/data/*.vmtrace``)."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


def builtin_traces():
    """``{name: path}`` of the traces shipped with vmalloc, sorted by name.

    ``vmalloc replay`` with no trace replays these. Each was recorded from a real model run
    (see docs/trace_formats.rst); ``open_trace(path)`` reads one.
    """
    if not DATA_DIR.is_dir():
        return {}
    return {p.name[: -len(".vmtrace")]: str(p) for p in sorted(DATA_DIR.glob("*.vmtrace"))}
