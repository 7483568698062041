"""Reading a function-sequence file (``FunctionSequence.load``) in bounded memory.

``json.loads`` of the whole file builds a Python object for every JSON value before anything is
checked: up to 24 times the text (an empty list, ``[],``, is 3 bytes of JSON and 64 of
Python), so a 45 KB gzip of 22 MB of JSON took 536 MiB. Here the text is walked once: the
records of ``variables`` and ``functions`` are matched one at a time by a regular expression of
their shape (C speed, nothing built), decoded by ``json.loads`` of that record alone and turned
into the sequence's own tuples at once; members the format does not read are skipped without
being decoded, and ``meta`` is decoded only up to :data:`MAX_META_BYTES` of JSON. The loader's
memory is therefore the decompressed text (at most ``MAX_FILE_BYTES``, read in blocks and
refused as soon as it passes the bound), one record's objects, and the sequence it returns;
the records' values (counted by their commas before a batch is decoded) are bounded too, since
a small gzip of tiny records would otherwise decode to gigabytes of Python objects.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import zlib

#: Bytes read (decompressed) at a time.
BLOCK = 1 << 20
#: The most JSON text ``meta`` may take (it is decoded as a whole).
MAX_META_BYTES = 16 << 20

_W = r"[ \t\n\r]*"
_STR = r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
_NUM = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALAR = rf"(?:{_STR}|{_NUM}|true|false|null)"
_LIST = rf"\[{_W}(?:{_SCALAR}{_W}(?:,{_W}{_SCALAR}{_W})*)?\]"
_WS = re.compile(_W)
_STRING = re.compile(_STR)
_SCALAR_RE = re.compile(_SCALAR)
#: A record: a flat list of scalars and lists of scalars (the shapes of both record kinds);
#: its fields are checked once decoded.
_REC = rf"\[{_W}(?:(?:{_SCALAR}|{_LIST}){_W}(?:,{_W}(?:{_SCALAR}|{_LIST}){_W})*)?\]"
_RECORD = re.compile(_REC)
#: Up to BATCH records and their commas, decoded by one json.loads.
BATCH = 1024
#: The most text a batch of records is matched in: the regular expression's backtracking
#: stack grows with a record's values (a record of 120 million ids took gigabytes), so a
#: record longer than this is refused (the shipped models' longest is under 1 KB).
MAX_RECORD_CHARS = 1 << 20
_RECORDS = re.compile(rf"{_REC}(?:{_W},{_W}{_REC}){{0,{BATCH - 1}}}")
#: What skipping an undecoded value looks at: strings (which may hold brackets) and brackets.
_TOKEN = re.compile(rf"{_STR}|[\[\]{{}}]|\"")


#: The members decoded whole (up to MAX_META_BYTES of JSON each); others are skipped.
_DECODED = ("format", "version", "name", "batch", "meta", "variables", "functions")


class _Bad(Exception):
    """The file breaks the format; args: (message, record or None)."""


class _Bound(_Bad):
    """A bound of the loader is passed: refused at once (the rest is not even skipped)."""


def read_text(path, limit, error):
    """The file's text, decompressed when it starts with the gzip magic bytes. Refuses what is
    not a regular file (a FIFO would block the reader forever, a device never end) and text
    past ``limit`` bytes, as soon as it passes. ``error(message)`` makes the exception."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"cannot read: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a device or socket")
            raise error(f"not a regular file ({kind}); refused")
        os.set_blocking(fd, True)
        raw = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    data = bytearray()
    try:
        with raw:
            head = raw.read(2)
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw) if head == b"\x1f\x8b" else raw
            while True:
                block = stream.read(BLOCK)
                if not block:
                    break
                data += block
                if len(data) > limit:
                    raise error(f"larger than {limit:,} bytes decompressed; refused (the "
                                "loader's bound, MAX_FILE_BYTES)")
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        # (BadGzipFile is an OSError: caught first)
        raise error(f"corrupt gzip data: {e}") from None
    except OSError as e:
        raise error(f"cannot read: {e.strerror or e}") from None
    try:
        return data.decode(json.detect_encoding(data), "surrogatepass")
    except (UnicodeDecodeError, LookupError) as e:
        raise error(f"not JSON: {e}") from None


def _not_json(text, pos, what):
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return _Bad(f"not JSON: {what}: line {line} column {column} (char {pos})", None)


def _skip(text, pos, endpos=None):
    """The end of the JSON value at ``pos`` (nothing decoded; containers by their brackets);
    None if it does not end before ``endpos`` (default: the text's end)."""
    m = _SCALAR_RE.match(text, pos)
    if m:
        return m.end()
    if pos >= len(text) or text[pos] not in "[{":
        raise _not_json(text, pos, "expecting value")
    depth = 0
    for m in _TOKEN.finditer(text, pos, len(text) if endpos is None else endpos):
        token = m.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return m.end()
        elif token == '"':
            raise _not_json(text, m.start(), "invalid string")
    if endpos is not None and endpos < len(text):
        return None
    raise _not_json(text, len(text), "unterminated container")


def _records(text, pos, name, convert, budget):
    """The records of the array at ``pos``: ``convert(record, index)`` of each, in a list;
    the end of the array. A record that is not a flat list (or that ``convert`` refuses)
    raises _Bad naming it. ``budget``: a one-item list, the values the records may still
    hold (each batch's commas are counted off before it is decoded)."""
    out = []
    pos = _WS.match(text, pos + 1).end()
    if text.startswith("]", pos):
        return out, pos + 1
    while True:
        m = _RECORDS.match(text, pos, pos + MAX_RECORD_CHARS)
        try:
            if m is None:  # not a flat list: refused undecoded, in convert's words
                end = _skip(text, pos, pos + MAX_RECORD_CHARS)
                if end is None:
                    raise _Bound(f"a record of more than {MAX_RECORD_CHARS:,} bytes of JSON, "
                               "the most the loader reads; refused", f"{name}[{len(out)}]")
                convert(text[pos:end][:80], len(out))
            budget[0] -= text.count(",", pos, m.end()) + 1
            if budget[0] < 0:
                raise _Bound(f"its records hold more than {budget[1]:,} values (numbers, "
                           "strings and ids); refused (the loader's bound, "
                           "MAX_RECORD_VALUES)", None)
            try:
                batch = json.loads("[" + m.group() + "]")
            except ValueError:  # an int of more than 4,300 digits: which record?
                batch = []
                for r in _RECORD.finditer(text, pos, m.end()):
                    try:
                        batch.append(json.loads(r.group()))
                    except ValueError:
                        batch.append(r.group()[:80])
            base = len(out)
            out.extend([convert(record, base + i) for i, record in enumerate(batch)])
        except ValueError as refused:
            raise _Bad(*refused.args) from None
        pos = _WS.match(text, m.end()).end()
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()
        elif text.startswith("]", pos):
            return out, pos + 1
        else:
            raise _not_json(text, pos, "expecting ',' delimiter")


def parse(text, convert_variable, convert_function, max_values):
    """The top-level object of a sequence file: ``{member: value}`` with ``variables`` and
    ``functions`` as lists of converted records (or, where a record is refused, the _Bad of
    the first), other arrays or objects than ``meta`` skipped (as ``...``), ``meta`` decoded.
    More than ``max_values`` values in the records raises _Bad before they are decoded."""
    budget = [max_values, max_values]
    pos = _WS.match(text).end()
    if not text.startswith("{", pos):
        _skip(text, pos)  # not JSON at all: say so
        return None
    members = {}
    pos = _WS.match(text, pos + 1).end()
    if text.startswith("}", pos):
        pos += 1
    else:
        while True:
            m = _STRING.match(text, pos)
            if m is None:
                raise _not_json(text, pos, "expecting property name enclosed in double quotes")
            key = json.loads(m.group())
            pos = _WS.match(text, m.end()).end()
            if not text.startswith(":", pos):
                raise _not_json(text, pos, "expecting ':' delimiter")
            pos = _WS.match(text, pos + 1).end()
            if key in ("variables", "functions") and text.startswith("[", pos):
                convert = convert_variable if key == "variables" else convert_function
                try:
                    members[key], pos = _records(text, pos, key, convert, budget)
                except _Bad as bad:
                    if bad.args[1] is None or isinstance(bad, _Bound):  # nothing else matters
                        raise
                    members[key] = bad
                    pos = _skip(text, pos)
            else:
                end = _skip(text, pos)
                if text[pos] in "[{" and key not in _DECODED:
                    members[key] = ...  # not read by the format: not decoded
                elif end - pos > MAX_META_BYTES:
                    raise _Bad(f"takes {end - pos:,} bytes of JSON, more than the "
                               f"{MAX_META_BYTES:,} the loader decodes; refused", key)
                else:
                    try:
                        members[key] = json.loads(text[pos:end])
                    except ValueError as e:
                        raise _not_json(text, pos, str(e)) from None
                    except RecursionError:
                        raise _Bad("JSON nested too deeply", None) from None
                pos = end
            pos = _WS.match(text, pos).end()
            if text.startswith(",", pos):
                pos = _WS.match(text, pos + 1).end()
            elif text.startswith("}", pos):
                pos += 1
                break
            else:
                raise _not_json(text, pos, "expecting ',' delimiter")
    pos = _WS.match(text, pos).end()
    if pos != len(text):
        raise _not_json(text, pos, "extra data")
    return members
