"""Opening trace files: gzip-compressed files are read transparently (profiler traces are
often saved as ``.json.gz``), text is strict UTF-8."""

import gzip
import io
import zlib

GZIP_MAGIC = b"\x1f\x8b"


def open_binary(path):
    """``path`` opened for binary reading, decompressed on the fly if it is gzip."""
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
