"""The second half of a raw-record reader (kineto, RMM CSV): a pass over its records collects
``metadata`` and counts ``skipped`` records by reason; :class:`RecordReaderPass` hands them to
the :class:`~vmalloc.traces.info.TraceInfo` and finds what was live before the window."""

from vmalloc.traces._normalize import scan_before_window


class RecordReaderPass:
    """Mixin for readers with ``records()``, a ``metadata`` dict and a ``skipped`` counter."""

    def live_before(self):
        """Addresses freed before being allocated in the input (``before_window="live"``)."""
        return self._live_before_rest(scan_before_window(self.records()))

    def _live_before_rest(self, before):
        """What the reader adds to the scan's ``before`` (after the pass that found it)."""
        return before

    def finish(self, info):
        """Adds what only a full pass knows to ``info``."""
        info.metadata.update(self.metadata)
        for reason, count in self.skipped.items():
            info.skip(reason, count)
        self.skipped = {}
