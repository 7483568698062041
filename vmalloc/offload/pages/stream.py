"""PageStream: host pages streamed to the device through the swap manager's pinned staging.

Page *i* is read (disk or memory) into a pinned block of the
:class:`~vmalloc.offload.SwapManager`'s staging pool on a worker thread, copied to the device
on the manager's host-to-device stream, and the consumer's stream waits for that copy on the
device. Pages *i+1 … i+prefetch* are read and copied while page *i* is in use. Pages that fit
the device budget stay resident across passes (copied once); the others share ``prefetch + 1``
slots. Every device buffer is allocated once, from the stream's allocator, so a page's pointer
is the same on every pass (the virtual allocator hands chunk-owning, pointer-stable buffers).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.swap import staging as _staging
from vmalloc.offload.pages.device_page import DevicePage
from vmalloc.offload.pages.plan import auto_prefetch, make_plan
from vmalloc.offload.pages.sources import PageSource
from vmalloc.sizes import parse_optional_size


class _Load:
    __slots__ = ("index", "target", "slot", "block", "future", "slot_event")

    def __init__(self, index, target, slot, block, slot_event):
        self.index, self.target, self.slot, self.block = index, target, slot, block
        self.slot_event = slot_event   # the consumer's release of the slot, or None
        self.future = None             # -> (bytes read from disk, the copy's event)


class PageStream:
    """Pages of host data, streamed to the device (see :doc:`data`).

    Args:
        pages: a sequence of NumPy arrays (``np.memmap`` pages are read from their files), or
            a callable making page *i* (then ``count``, ``dtype`` and ``page_shape`` are
            required). Every page has the same dtype and row shape (``shape[1:]``).
        allocator: the :class:`vmalloc.Allocator` the device buffers come from (its device
            must be backed), or ``manager``: a :class:`~vmalloc.offload.SwapManager` whose
            allocator, staging pool and host-to-device stream the stream uses.
        prefetch: pages copied ahead of the one in use; ``None`` picks it from the link's
            bandwidth and the page size (:func:`~vmalloc.offload.pages.plan.auto_prefetch`).
        budget: device bytes the stream may hold (int or ``"2GiB"``); ``None``: every page
            stays resident.
        workers: threads reading pages.
        stream: the consumer's stream: pages are ready for work queued on it.
        strict: raise instead of warning when the budget lowers ``prefetch``.
    """

    def __init__(self, pages, allocator=None, *, manager=None, count=None, dtype=None,
                 page_shape=None, prefetch=None, budget=None, workers=2, stream=0,
                 strict=False):
        from vmalloc.offload.swap import SwapManager
        if (allocator is None) == (manager is None):
            raise InvalidArgumentError("give a PageStream an allocator or a manager (one)")
        self._source = PageSource(pages, count=count, dtype=dtype, page_shape=page_shape)
        self.manager = manager if manager is not None else SwapManager(allocator)
        self.device = self.manager.allocator.device
        self.stream = stream
        self._h2d = self.manager.streams[1]
        if prefetch is None:
            link = self.device.cost_model().get("to_device_bytes_per_second")
            prefetch = auto_prefetch(max(self._source.nbytes), link)
        budget = parse_optional_size(budget, "budget", "no limit") or None
        self.plan = make_plan(self._source.nbytes, budget, int(prefetch), strict=strict)
        self._lock = threading.RLock()
        self._counts = dict(pages_served=0, pages_copied=0, bytes_copied=0,
                            bytes_read_from_disk=0, resident_hits=0, host_waits=0,
                            host_wait_seconds=0.0, evicted_prefetches=0, rows_gathered=0)
        self._ptrs, self._free_slots, self._buffers = {}, [], {}
        self._loads, self._loaded, self._slot_free_event = {}, set(), {}
        self._retired = []      # (block, event): staging blocks whose copy may be in flight
        self._current = None    # (index, slot or None) of the page in use
        self._closed = False
        self._pool = None
        try:
            for i in sorted(self.plan.resident):
                self._ptrs[i] = self.manager.allocate(self._source.nbytes[i], stream=stream)
            for _ in range(self.plan.slots):
                self._free_slots.append(self.manager.allocate(self.plan.slot_bytes,
                                                              stream=stream))
        except BaseException:
            self._free_device()
            raise
        self._pool = ThreadPoolExecutor(max(1, int(workers)), thread_name_prefix="vmalloc-pages")

    # --- the public API ---

    def __len__(self):
        return self._source.count

    def __iter__(self):
        """One pass: pages ``0 … len-1`` in order."""
        for i in range(len(self)):
            yield self.page(i)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def row_offsets(self):
        """Global row number of each page's first row, and the total (``len + 1`` ints)."""
        out = [0]
        for r in self._source.rows:
            out.append(out[-1] + r)
        return out

    def page(self, index):
        """Page ``index`` on the device (:class:`DevicePage`); starts copying the pages after
        it. The previous streamed page's buffer may be reused from now on."""
        with self._lock:
            self._check_open()
            if not isinstance(index, int) or not 0 <= index < len(self):
                raise IndexError(f"page index {index!r} out of range(0, {len(self)})")
            self._release_current()
            try:
                return self._serve(index)
            finally:
                self._reap()

    def _serve(self, index):
        resident = index in self.plan.resident
        if self._source.nbytes[index] == 0:
            ptr = 0     # an empty page: nothing to copy, no buffer
        elif resident and index in self._loaded:
            self._counts["resident_hits"] += 1
            ptr = self._ptrs[index]
        else:
            load = self._loads.pop(index, None) or self._start(index)
            ptr = self._finish(load)
        self._current = (index, None if resident or not ptr else ptr)
        self._counts["pages_served"] += 1
        self._prefetch_after(index)
        return DevicePage(self, index, ptr, resident)

    def gather(self, rows):
        """The rows ``rows`` (global row numbers, in any order) of every page compacted into
        one new device buffer, in the order given (a
        :class:`~vmalloc.offload.pages.GatheredRows`; free it, or :meth:`close` does)."""
        from vmalloc.offload.pages.gather import gather
        with self._lock:
            self._check_open()
            return gather(self, rows)

    def stats(self):
        """A dict: ``pages_served``, ``pages_copied`` and ``bytes_copied`` (host to device;
        a prefetched copy counts once the stream has waited for it or dropped it),
        ``bytes_read_from_disk``, ``resident_hits`` (pages served from the resident cache),
        ``host_waits`` and ``host_wait_seconds`` (the consumer waited for a page read),
        ``evicted_prefetches`` (prefetched pages dropped for a random access),
        ``rows_gathered``, and the plan: ``prefetch``, ``asked_prefetch``,
        ``resident_pages``, ``resident_bytes``, ``slots``, ``slot_bytes``."""
        with self._lock:
            if not self._closed:
                self._reap()    # staging blocks of completed copies go back first
            out = dict(self._counts)
        out.update(prefetch=self.plan.prefetch, asked_prefetch=self.plan.asked_prefetch,
                   resident_pages=len(self.plan.resident),
                   resident_bytes=sum(self._source.nbytes[i] for i in self.plan.resident),
                   slots=self.plan.slots, slot_bytes=self.plan.slot_bytes)
        return out

    def close(self):
        """Waits for reads and copies in flight, returns every staging block and frees every
        device buffer (pages and gathered rows). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                for load in list(self._loads.values()):
                    self._drop(load)
                self._loads.clear()
                self.device.synchronize_stream(self._h2d)
                self._reap(wait=True)
                for event in self._slot_free_event.values():
                    self.device.destroy_event(event)
                self._slot_free_event.clear()
            finally:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                self._free_device()

    # --- loading ---

    def _check_open(self):
        if self._closed:
            raise InvalidArgumentError("the PageStream is closed")

    def _release_current(self):
        if self._current is None:
            return
        _, slot = self._current
        self._current = None
        if slot is not None:
            # The next copy into this slot waits (on the device) for the consumer's work.
            event = self.device.create_event()
            self.device.record_event(event, stream=self.stream)
            old = self._slot_free_event.pop(slot, None)
            if old is not None:
                self.device.destroy_event(old)
            self._slot_free_event[slot] = event
            self._free_slots.append(slot)

    def _start(self, index):
        nbytes = self._source.nbytes[index]
        slot = None
        if index in self.plan.resident:
            target = self._ptrs[index]
        else:
            if not self._free_slots:
                self._evict()
            target = slot = self._free_slots.pop()
        try:
            block = _staging.stage(self.manager, max(nbytes, 1))
        except BaseException:
            if slot is not None:
                self._free_slots.append(slot)
            raise
        load = _Load(index, target, slot, block, self._slot_free_event.pop(slot, None))
        try:
            load.future = self._pool.submit(self._read_and_copy, load)
        except BaseException:
            self._drop(load)
            raise
        return load

    def _read_and_copy(self, load):
        """On a worker thread: reads the page into its staging block and issues its copy on
        the manager's host-to-device stream at once (after the consumer's release of the
        slot), so the copy overlaps the consumer's work on the page before. Returns (bytes
        read from disk, the copy's event)."""
        disk = self._source.read_into(load.index, load.block, _staging.fill)
        device, nbytes = self.device, self._source.nbytes[load.index]
        if load.slot_event is not None:
            device.wait_event(self._h2d, load.slot_event)
        if nbytes:
            device.copy_to_device(load.target, load.block, nbytes, stream=self._h2d)
        event = device.create_event()
        try:
            device.record_event(event, stream=self._h2d)
        except BaseException:
            device.destroy_event(event)
            raise
        return disk, event

    def _evict(self, load=None):
        """Frees a slot for a page asked out of order: drops ``load``, by default the latest
        prefetch (its read and copy are waited for, its data discarded)."""
        if load is None:
            victims = [x for x in self._loads.values() if x.slot is not None]
            if not victims:
                raise InvalidArgumentError("no streaming slot is free (internal)")
            load = victims[-1]
        del self._loads[load.index]
        self._drop(load)
        self._counts["evicted_prefetches"] += 1

    def _settle(self, load):
        """The load's (bytes read, copy event) once its worker is done, its copy counted, the
        slot's release event destroyed; raises the worker's error."""
        try:
            disk, event = load.future.result() if load.future is not None else (0, None)
        finally:
            if load.slot_event is not None:
                self.device.destroy_event(load.slot_event)
                load.slot_event = None
        if event is not None:
            self._counts["bytes_read_from_disk"] += disk
            self._counts["pages_copied"] += 1
            self._counts["bytes_copied"] += self._source.nbytes[load.index]
        return event

    def _drop(self, load):
        """Abandons a load: waits for its read (errors dropped: the page was not asked for)
        and its copy, returns its block and slot."""
        try:
            event = self._settle(load)
        except BaseException:
            event = None
            # A failed worker may have issued the copy before failing: the block is reused
            # only once the stream has drained.
            self.device.synchronize_stream(self._h2d)
        if event is not None:
            self.device.synchronize_event(event)
            self._retired.append((load.block, event))
        else:
            _staging.unstage(self.manager, load.block)
        if load.slot is not None:
            self._free_slots.append(load.slot)

    def _finish(self, load):
        """Page ``load.index`` read and its copy issued; the consumer's stream waits for it."""
        try:
            if not load.future.done():
                began = time.perf_counter()
                self._counts["host_waits"] += 1
                try:
                    load.future.exception()
                finally:
                    self._counts["host_wait_seconds"] += time.perf_counter() - began
            event = self._settle(load)
        except BaseException:
            self._drop(load)
            raise
        self._retired.append((load.block, event))
        self.device.wait_event(self.stream, event)
        if load.slot is None:
            self._loaded.add(load.index)
        return load.target

    def _prefetch_after(self, index):
        """Starts the reads (and copies) of the next ``prefetch`` pages needing a copy
        (wrapping around: the next pass)."""
        count, want = len(self), self.plan.prefetch
        ahead = []
        for step in range(1, count):
            j = (index + step) % count
            if (j in self.plan.resident and j in self._loaded) or not self._source.nbytes[j]:
                continue
            ahead.append(j)
            if len(ahead) == want:
                break
        for j in ahead:
            if j in self._loads:
                continue
            if j not in self.plan.resident and not self._free_slots:
                # A random access left prefetches outside the window: drop one for this page.
                stale = [x for x in self._loads.values() if x.slot is not None and
                         x.index not in ahead]
                if not stale:
                    break
                self._evict(stale[-1])
            self._loads[j] = self._start(j)

    def _reap(self, wait=False):
        """Returns the staging blocks whose copies have completed."""
        keep = []
        for block, event in self._retired:
            if wait or self.device.query_event(event):
                if wait:
                    self.device.synchronize_event(event)
                _staging.unstage(self.manager, block)
                self.device.destroy_event(event)
            else:
                keep.append((block, event))
        self._retired = keep

    def _free_device(self):
        ptrs = list(self._ptrs.values()) + self._free_slots + list(self._buffers)
        if self._current is not None and self._current[1] is not None:
            ptrs.append(self._current[1])
        self._ptrs, self._free_slots, self._buffers, self._current = {}, [], {}, None
        for ptr in ptrs:
            self.manager.deallocate(ptr, stream=self.stream)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        p = self.plan
        return (f"<PageStream {len(self)} pages, {len(p.resident)} resident, {p.slots} slots "
                f"of {p.slot_bytes} bytes, prefetch {p.prefetch}>")
