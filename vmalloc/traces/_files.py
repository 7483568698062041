"""Opening trace files: gzip-compressed files are read transparently (profiler traces are
often saved as ``.json.gz``), text is strict UTF-8.

Every reader streams: decompression happens block by block as the reader asks, text is read a
line (bounded by :data:`MAX_LINE_CHARS`) or a chunk at a time, and a format that must be held
whole (a pickle) is read through :class:`CappedReader`, so a hostile file (a gzip bomb, a line
without end, ``/dev/zero``) is refused with a :class:`~vmalloc.TraceFormatError` instead of
filling memory.
"""

import contextlib
import gzip
import io
import os
import zlib

from vmalloc.errors import TraceFormatError

GZIP_MAGIC = b"\x1f\x8b"

#: A text line longer than this (a CSV record) is taken as corruption: real ones are < 1 KiB.
MAX_LINE_CHARS = 1 << 20


#: Called as ``hook(path, bytes_read, file_bytes)`` as trace files are read (at most every
#: 64 KiB, by the reader's own reads), when set: the command line's progress bar for reading.
#: None (the default): files are read directly.
progress_hook = None


class _Watched(io.RawIOBase):
    """A raw file that reports its position to :data:`progress_hook` as it is read."""

    def __init__(self, f, path, hook):
        self._f, self._path, self._hook = f, os.fspath(path), hook
        try:
            self._size = os.fstat(f.fileno()).st_size
        except OSError:
            self._size = 0
        self._done = 0

    def readable(self):
        return True

    def readinto(self, buffer):
        n = self._f.readinto(buffer)
        if n:
            self._done += n
            self._hook(self._path, self._done, self._size)
        return n

    def close(self):
        self._f.close()
        super().close()


def open_binary(path):
    """``path`` opened for binary reading, decompressed on the fly if it is gzip."""
    hook = progress_hook
    if hook is not None:
        raw = open(path, "rb", buffering=0)
        f = io.BufferedReader(_Watched(raw, path, hook), 1 << 16)
    else:
        f = open(path, "rb")
    try:
        if f.peek(2)[:2] == GZIP_MAGIC:
            return gzip.GzipFile(fileobj=f, mode="rb")
    except Exception:
        f.close()
        raise
    return f


def head(path, n=4096):
    """The first ``n`` bytes of the (decompressed) file; fewer if it is shorter or corrupt."""
    with open_binary(path) as f:
        try:
            return f.read(n)
        except (OSError, EOFError, zlib.error):  # corrupt: let the reader say why
            return b""


def open_text(path):
    """``path`` as UTF-8 text (a UTF-8 byte-order mark is skipped), lines kept as written."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", errors="strict", newline="")


class CappedReader(io.RawIOBase):
    """A binary file that refuses to deliver more than ``limit`` bytes in all: a read that
    would pass the limit raises TraceFormatError *before* reading (so a header announcing a
    5 GB string, or a gzip bomb, costs nothing). ``readline`` is bounded too."""

    def __init__(self, f, limit, path, what):
        self._f, self.limit, self.path, self.what = f, limit, path, what
        self.consumed = 0

    def readable(self):
        return True

    def _allow(self, n):
        if n is None or n < 0 or self.consumed + n > self.limit:
            # Reading "everything" or past the limit: allowed only if the file ends first.
            n = self.limit - self.consumed + 1
        return n

    def _count(self, data):
        self.consumed += len(data)
        if self.consumed > self.limit:
            raise TraceFormatError(
                f"{self.what} is larger than vmalloc's limit of {self.limit:,} bytes "
                "(decompressed): refusing to read it", self.path)
        return data

    def read(self, n=-1):
        if n is not None and n >= 0 and self.consumed + n > self.limit:
            raise TraceFormatError(
                f"{self.what} asks for {n:,} more bytes, past vmalloc's limit of "
                f"{self.limit:,} bytes: refusing to read it", self.path)
        return self._count(self._f.read(self._allow(n)))

    def readinto(self, buffer):
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, n=-1):
        bound = MAX_LINE_CHARS if n is None or n < 0 else min(n, MAX_LINE_CHARS)
        line = self._count(self._f.readline(bound + 1))
        if len(line) > bound and (n is None or n < 0 or n > MAX_LINE_CHARS):
            raise TraceFormatError(
                f"{self.what} has a line longer than {MAX_LINE_CHARS:,} bytes", self.path)
        return line


def bounded_lines(text, path, limit=MAX_LINE_CHARS):
    """The lines of the text file ``text`` (as ``iter(text)`` gives them), each read with a
    bound: a line longer than ``limit`` characters is a TraceFormatError naming its number, so
    a file without newlines (``/dev/zero``) is refused after ``limit`` characters, not read
    whole."""
    number = 0
    while True:
        line = text.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit:
            raise TraceFormatError(
                f"line {number} is longer than {limit:,} characters: not a trace of this "
                "format (or corrupt)", path, number)
        yield line


@contextlib.contextmanager
def atomic_output(path):
    """Yields the name to write ``path`` under: a file beside it, renamed to ``path`` once
    the block ends, removed if it raises, so ``path`` appears only once complete. An OSError
    names ``path``, never the temporary name (the user did not choose it and would not find
    it: it is gone)."""
    partial = path + ".partial"
    try:
        yield partial
        os.replace(partial, path)
    except BaseException as error:
        try:
            os.remove(partial)
        except OSError:
            pass
        if isinstance(error, OSError) and partial in (error.filename, error.filename2):
            # OSError(errno, ...) gives the subclass of the errno (IsADirectoryError...)
            raise OSError(error.errno, error.strerror, path) from None
        raise
