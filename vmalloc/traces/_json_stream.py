"""An incremental reader of the ``traceEvents`` array of a chrome-trace JSON file.

Profiler traces reach gigabytes, so ``json.load`` (the whole document as Python objects) is
out. The scanner walks the top level itself and hands each array element to the C-accelerated
``json.JSONDecoder.raw_decode`` from a sliding buffer, so memory stays at one buffer plus one
event, and every event is decoded at C speed. It tracks line numbers for error messages.
"""

import json
import re
import zlib

from vmalloc.errors import TraceFormatError

_CHUNK = 1 << 20
#: A single event larger than this is taken as corruption (real ones are below a few KiB).
_MAX_EVENT_CHARS = 16 << 20
_SKIP_WHITESPACE = re.compile(r"[ \t\n\r]*").match


class JsonEventScanner:
    """Yields ``(line, event)`` for each element of the trace's ``traceEvents`` array (or of
    the top-level array, chrome's "JSON Array Format"); ``metadata`` collects the top-level
    scalar members (``schemaVersion``, ``displayTimeUnit``, ...)."""

    def __init__(self, text_file, path):
        self._file = text_file
        self.path = path
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._line = 1  # line number at self._counted
        self._counted = 0
        self._decoder = json.JSONDecoder()
        self.metadata = {}

    # -- buffer -------------------------------------------------------------------------

    def _fill(self):
        """Reads another chunk, dropping what has been consumed. False at end of file."""
        if self._eof:
            return False
        try:
            chunk = self._file.read(_CHUNK)
        except UnicodeDecodeError as error:
            raise TraceFormatError(f"not UTF-8 text ({error.reason})", self.path, self._line_at(self._pos))
        except (OSError, EOFError, zlib.error) as error:  # a truncated or corrupt .gz
            raise TraceFormatError(f"cannot read: {error}", self.path, self._line_at(self._pos))
        if not chunk:
            self._eof = True
            return False
        self._line_at(self._pos)
        self._buf = self._buf[self._pos :] + chunk
        self._counted -= self._pos
        self._pos = 0
        return True

    def _line_at(self, pos):
        if pos > self._counted:
            self._line += self._buf.count("\n", self._counted, pos)
            self._counted = pos
        return self._line

    def _error(self, message, pos=None):
        return TraceFormatError(message, self.path, self._line_at(self._pos if pos is None else pos))

    def _peek(self):
        """The next non-whitespace character (consumed up to it), or '' at end of file."""
        while True:
            buf = self._buf
            pos = _SKIP_WHITESPACE(buf, self._pos).end()
            self._pos = pos
            if pos < len(buf):
                return buf[pos]
            if not self._fill():
                return ""

    def _expect(self, chars, what):
        c = self._peek()
        if c == "" or c not in chars:
            found = "end of file" if c == "" else repr(c)
            raise self._error(f"expected {what}, found {found}")
        self._pos += 1
        return c

    def _value(self):
        """Decodes the JSON value at the cursor, reading more of the file as needed."""
        self._peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as error:
                if len(self._buf) - self._pos < _MAX_EVENT_CHARS and self._fill():
                    continue  # the value may just be cut by the end of the buffer
                raise self._error(f"invalid JSON: {error.msg}", error.pos) from None
            except RecursionError:
                raise self._error("invalid JSON: nested too deeply") from None
            except ValueError as error:  # e.g. an integer beyond Python's digit limit
                raise self._error(f"invalid JSON: {error}") from None
            if end == len(self._buf) and not isinstance(value, (dict, list, str)) and self._fill():
                continue  # a number or literal may continue in the next chunk
            self._pos = end
            return value

    # -- structure ----------------------------------------------------------------------

    def events(self):
        """Yields ``(line, event)`` for every element of the events array."""
        first = self._peek()
        if first == "[":
            self._pos += 1
            yield from self._array()
        elif first == "{":
            self._pos += 1
            found = False
            if self._peek() == "}":
                self._pos += 1
            else:
                while True:
                    key = self._value() if self._peek() == '"' else None
                    if not isinstance(key, str):
                        raise self._error("expected a member name (a string)")
                    self._expect(":", "':'")
                    if key == "traceEvents":
                        found = True
                        self._expect("[", "'[' starting traceEvents")
                        yield from self._array()
                    else:
                        value = self._value()
                        if value is None or isinstance(value, (str, int, float, bool)):
                            self.metadata[key] = value
                    if self._expect(",}", "',' or '}'") == "}":
                        break
            if not found:
                raise self._error("no 'traceEvents' array: not a chrome/Kineto trace")
        else:
            raise self._error(
                "not a chrome/Kineto trace: expected a JSON object or array, found "
                + ("end of file" if first == "" else repr(first))
            )
        if self._peek() != "":
            raise self._error("unexpected data after the trace")

    def _array(self):
        if self._peek() == "]":
            self._pos += 1
            return
        while True:
            self._peek()
            line = self._line_at(self._pos)
            value = self._value()
            yield line, value
            if self._expect(",]", "',' or ']'") == "]":
                return
