"""Progress bars on stderr while a replay reads and runs a trace."""

import sys
import time
from pathlib import Path

from vmalloc.sizes import format_size


class _Progress:
    """A one-line progress bar on stderr, redrawn at most five times a second and erased by
    :meth:`close`. Hand-written rather than tqdm: one line, no dependency, and the few things
    needed here (events or bytes, an unknown total) are 30 lines."""

    def __init__(self, label, total, stream, unit="events"):
        self.label = label if len(label) <= 60 else label[:57] + "..."
        self.total, self.stream, self.unit = total, stream, unit
        self.last = 0.0
        self.drawn = False

    def update(self, done, force=False):
        now = time.monotonic()
        if not force and now - self.last < 0.2:
            return
        self.last = now
        count = format_size if self.unit == "bytes" else (lambda n: f"{n:,}")
        unit = "" if self.unit == "bytes" else f" {self.unit}"
        if self.total:
            frac = min(1.0, done / self.total)
            bar = "#" * int(frac * 20)
            text = f"{self.label} [{bar:<20}] {frac:6.1%} of {count(self.total)}{unit}"
        else:
            text = f"{self.label} {count(done)}{unit}"
        width = _terminal_width()
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()
        self.drawn = True

    def close(self):
        if self.drawn:
            self.stream.write("\r" + " " * _terminal_width() + "\r")
            self.stream.flush()
            self.drawn = False


def _terminal_width():
    import shutil

    return max(20, min(120, shutil.get_terminal_size((80, 24)).columns - 1))


class reading_progress:
    """A context in which reading trace files draws a progress bar of the bytes read (on
    ``stream``, default stderr): the passes that come before any event is replayed, such as
    finding a profiler trace's devices or what was live before its window."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.bar = None
        self.saved = None

    def _hook(self, path, done, total):
        if self.bar is None or self.bar.path != path:
            if self.bar is not None:
                self.bar.close()
            self.bar = _Progress(f"reading {Path(path).name}", total, self.stream, "bytes")
            self.bar.path = path
        self.bar.update(done)

    def __enter__(self):
        from vmalloc.traces import _files

        self.saved, _files.progress_hook = _files.progress_hook, self._hook
        return self

    def __exit__(self, *exc):
        from vmalloc.traces import _files

        _files.progress_hook = self.saved
        if self.bar is not None:
            self.bar.close()
