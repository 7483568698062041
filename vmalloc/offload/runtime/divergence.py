"""Divergence: a program may depart from its record (a data-dependent branch, a longer or
shorter iteration, a larger allocation) or fail part-way (an out-of-memory, a refused swap-in).
The runtime then stops following the schedule, runs the rest of the iteration on demand, and
records the next iteration anew."""

from __future__ import annotations


class Divergence:
    """The divergence half of :class:`~vmalloc.offload.Runtime` (a mixin)."""

    def invalidate(self, reason: str = "invalidated by the driver") -> None:
        """Drops the record and the schedule: the rest of this iteration (if one is running)
        runs on demand and the next iteration is recorded anew. For a driver that learns the
        record is wrong (say, an optimizer first seen after its parameters were recorded)."""
        self._diverge(str(reason))

    def _matches(self, i, name, reads, writes):
        """Whether the running function is the recorded function i."""
        if i >= len(self._sequence.functions):
            return False
        f = self._sequence.functions[i]
        if f.name != name:
            return False
        var = self._var_of_buf.get
        # Writes may grow during the function (a framework's new outputs): those known at
        # entry must begin the recorded outputs.
        return (tuple(var(b.id) for b in reads) == f.inputs
                and tuple(var(b.id) for b in writes) == f.outputs[:len(writes)])

    def _diverge(self, reason=None):
        if reason is not None:
            self.last_divergence = reason
        if self._following:
            self._stats["diverged_iterations"] += 1
            self._following = False
        # The next iteration records anew and is scheduled again.
        self._schedule = None
        self._sequence = None
        self.last_schedule_error = None

    def _abandon(self, reason):
        """A failure inside an iteration (an exception in a function's entry, body or exit):
        the iteration's record is incomplete and its schedule's state unknown. Stop following
        and recording; the next iteration records anew."""
        self._pre_pending = False
        self._pending_in = [b for b in self._pending_in if b.alive and b.where == "swapping_in"]
        self._stats["failed_functions"] += 1
        if self._in_iteration:
            self._recording = False
            self._diverge(reason)
