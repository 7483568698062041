"""Reader of RMM memory-event logs (``rmm.mr.LoggingResourceAdaptor``'s CSV).

The header names the columns, ``Thread,Time,Action,Pointer,Size,Stream``; columns are found by
name, so extra ones are ignored and ``Stream`` may be missing (stream 0). Actions:
``allocate`` -> ALLOC, ``free`` (``deallocate`` accepted too) -> FREE, ``allocate failure`` is
counted in ``info.skipped``. Pointers and streams are hexadecimal as RMM prints them
(``0x7f...``, ``(nil)`` for null). RMM writes ``free`` before handing memory back and
``allocate`` after receiving it, so file order is a valid order even for many threads. The file
is streamed line by line; one log holds one device's resource, so ``device`` is not used.
"""

import csv
import re
import zlib

from vmalloc.errors import TraceFormatError
from vmalloc.traces._fields import U64_MAX
from vmalloc.traces._files import bounded_lines, open_text
from vmalloc.traces._record_reader import RecordReaderPass
from vmalloc.traces.events import ALLOC, FREE

REQUIRED_COLUMNS = ("Action", "Pointer", "Size")
_ACTIONS = {"allocate": ALLOC, "free": FREE, "deallocate": FREE}
_SKIPPED_ACTIONS = ("allocate failure",)


_HEX = re.compile(r"(?:0[xX])?([0-9a-fA-F]{1,16})")
_DECIMAL = re.compile(r"[0-9]{1,20}")


def _hex(text, what, path, line):
    try:
        value = int(text, 16)  # the common case, fast: "0x7f8a40000000"
    except ValueError:
        value = -1
    if 0 <= value <= U64_MAX and "_" not in text:  # int() also takes "1_0" digit groups
        return value
    t = text.strip()
    if t.lower() in ("(nil)", "nil", "null", "nullptr"):
        return 0
    match = _HEX.fullmatch(t)
    if match is None:
        raise TraceFormatError(f"{what} must be a hexadecimal address, got {text!r:.60}", path, line)
    return int(match.group(1), 16)


def _size(text, path, line):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if 0 <= value <= U64_MAX and "_" not in text:
        return value
    t = text.strip()
    if _DECIMAL.fullmatch(t) is None:
        raise TraceFormatError(f"Size must be a non-negative integer, got {text!r:.60}", path, line)
    value = int(t)
    if value > U64_MAX:
        raise TraceFormatError(f"Size {value} does not fit in 64 bits", path, line)
    return value


class RmmCsvReader(RecordReaderPass):
    """The events of an RMM logging CSV."""

    format = "rmm_csv"
    direct = False

    def __init__(self, path, kind, index):
        self.path = path
        self.metadata = {}
        self.skipped = {}

    def records(self):
        """``(op, stream, addr, size)`` for every allocate and free line, in file order."""
        path = self.path
        self.skipped = {}  # counts of this pass only (a before_window="live" scan is another)
        with open_text(path) as text:
            # Lines are read with a bound (a file without newlines is refused, not read whole).
            rows = csv.reader(bounded_lines(text, path), strict=True)
            try:
                header = next(rows, None)
                if header is None:
                    raise TraceFormatError("empty file: not an RMM log", path, 1)
                names = [h.strip() for h in header]
                missing = [c for c in REQUIRED_COLUMNS if c not in names]
                if missing:
                    raise TraceFormatError(
                        "not an RMM log: the header lacks "
                        + ", ".join(missing)
                        + " (expected Thread,Time,Action,Pointer,Size,Stream)",
                        path,
                        1,
                    )
                i_action = names.index("Action")
                i_pointer = names.index("Pointer")
                i_size = names.index("Size")
                i_stream = names.index("Stream") if "Stream" in names else None
                width = max(i_action, i_pointer, i_size, -1 if i_stream is None else i_stream) + 1
                self.metadata = {"columns": names}
                for row in rows:
                    line = rows.line_num
                    if not row:
                        continue  # blank line
                    if len(row) < width:
                        raise TraceFormatError(
                            f"{len(row)} columns, expected {len(names)}", path, line
                        )
                    action = row[i_action].strip()
                    op = _ACTIONS.get(action)
                    if op is None:
                        if action in _SKIPPED_ACTIONS:
                            self.skipped[action] = self.skipped.get(action, 0) + 1
                            continue
                        raise TraceFormatError(
                            f"unknown action {action!r:.40} (expected allocate, free or "
                            "allocate failure)",
                            path,
                            line,
                        )
                    addr = _hex(row[i_pointer], "Pointer", path, line)
                    size = _size(row[i_size], path, line)
                    stream = 0 if i_stream is None else _hex(row[i_stream], "Stream", path, line)
                    yield op, stream, addr, size
            except csv.Error as error:
                raise TraceFormatError(f"malformed CSV: {error}", path, max(rows.line_num, 1)) from None
            except UnicodeDecodeError as error:
                raise TraceFormatError(
                    f"not UTF-8 text ({error.reason})", path, rows.line_num + 1
                ) from None
            except (OSError, EOFError, zlib.error) as error:  # a truncated or corrupt .gz
                raise TraceFormatError(f"cannot read: {error}", path, rows.line_num + 1) from None
