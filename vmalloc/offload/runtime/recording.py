"""Recording: the first iteration (and the first after the program changed) runs on demand
while the runtime notes its functions and allocations; at its end the record becomes a
:class:`~vmalloc.offload.FunctionSequence` and is scheduled. A budget no schedule fits is said
once (a warning naming the function and the bytes it needs, ``stats()["schedule_error"]``), or
raised under ``strict=True``."""

from __future__ import annotations

import os
import sys
import warnings


class BudgetWarning(UserWarning):
    """The runtime cannot keep its budget promise (no schedule fits, or the budget exceeds the
    device): it says so once, then runs on demand."""


def _library_files():
    """File name prefixes that are not the program's: vmalloc, contextlib (the ``with``
    blocks) and the framework a driver runs (its ops and hooks call into the driver)."""
    import contextlib

    import vmalloc

    prefixes = [os.path.dirname(vmalloc.__file__) + os.sep, contextlib.__file__]
    for name in ("torch", "nnabla", "cupy"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            prefixes.append(os.path.dirname(path) + os.sep)
    return tuple(prefixes)


def warn_user(message, category=BudgetWarning):
    """``warnings.warn`` pointing at the program's line: the first caller outside the
    library files (a fixed stacklevel points into vmalloc or PyTorch, whichever path the
    warning took)."""
    skip = _library_files()
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


class Recording:
    """The recording half of :class:`~vmalloc.offload.Runtime` (a mixin)."""

    def running_function(self):
        """The running function as every budget message names it, ``"function 3 (name)"``
        (its index in the iteration); None outside functions."""
        return f"function {self._step} ({self._fn_name})" if self._in_function else None

    def say_budget(self, message) -> bool:
        """Says that the budget cannot be kept, once per runtime: a :class:`BudgetWarning`
        pointing at the program's line (later broken promises are counted in ``stats()``,
        not said again). For a driver that finds one itself (an op whose outputs do not
        fit); returns whether it warned."""
        if self._warned_unschedulable:
            return False
        self._warned_unschedulable = True
        warn_user(message)
        return True

    def _note_transient(self, buf):
        k = len(self._iter_allocs)
        self._iter_allocs.append(buf)
        if self._recording:
            self._record_allocs.append(buf)
        elif self._following and k < len(self._transient_vars):
            v = self._transient_vars[k]
            recorded = self._sequence.variables[v].nbytes
            if buf.footprint > recorded:
                # Larger than planned: the schedule's budget no longer holds.
                self._diverge(f"allocation {k} of the iteration has {buf.nbytes} bytes; the "
                              f"record has {recorded}")
                return
            self._var_of_buf[buf.id] = v
            self._buf_of_var[v] = buf

    def _start_record(self):
        self._record_funcs = []
        self._record_rerunnable = set()
        self._rc_excluded = set()     # (variable ids of the record to come)
        self._rc_refused = {}
        self._record_allocs = []
        self._record_persistent = [b for b in self._buffers.values() if b.persistent]

    def _build_schedule(self, keep_old=False) -> bool:
        """Schedules the record (the first persistent mode that fits, see :meth:`_plan`) and
        returns whether a schedule fits. ``keep_old``: a budget none fits changes nothing (the
        plan that stands stays, nothing is said or counted); else it is said
        (:meth:`_unschedulable`) and iterations run on demand."""
        seq, var_of, persistent, transient = self._record_sequence()
        before = (self._rc_chain, self._recompute_reason)
        schedule, error = self._plan(seq)
        if schedule is None and keep_old:
            self._rc_chain, self._recompute_reason = before
            return False
        had_schedule = self._sequence is not None or self._stats["recorded_iterations"] > 1
        self._record_persistent, self._record_allocs = persistent, transient
        self._sequence = seq
        self._persistent_vars = {buf.id: var_of[id(buf)] for buf in persistent
                                 if id(buf) in var_of}
        for buf in persistent:
            buf.var = var_of.get(id(buf))
        self._transient_vars = [var_of[id(b)] for b in transient]
        self._schedule, self.last_schedule_error = schedule, error
        if self._recompute_reason is not None and not self._warned_recompute:
            self._warned_recompute = True     # said once; stats() keeps the latest
            warn_user(f"recompute=True recomputes nothing: {self._recompute_reason}",
                      UserWarning)
        if had_schedule:
            self._stats["reschedules"] += 1
        if schedule is None:
            self._stats["schedule_failures"] += 1
            self._unschedulable(seq, error)
        else:
            self._schedule_error = None
            self._plan_compression()
        return schedule is not None

    def _record_sequence(self):
        """The record as a FunctionSequence: ``(seq, var_of, persistent, transient)``, the
        last two the record's buffers once those the driver marked persistent before the
        iteration ended (they outlive it: nnabla's uncleared arrays) count as persistent."""
        from vmalloc.offload.sequence.sequence import FunctionSequence

        seq = FunctionSequence(name="runtime")
        var_of = {}
        promoted = [b for b in self._record_allocs if b.persistent]
        persistent = self._record_persistent + [
            b for b in promoted if b not in self._record_persistent]
        transient = [b for b in self._record_allocs if not b.persistent]
        for buf in persistent:
            if buf.alive:
                var_of[id(buf)] = seq.add_variable(buf.footprint, persistent=True,
                                                   name=f"b{buf.id}")
        for k, buf in enumerate(transient):
            var_of[id(buf)] = seq.add_variable(buf.footprint, persistent=False,
                                               name=f"t{k}")
        for name, reads, writes in self._record_funcs:
            seq.add_function(inputs=[var_of[id(b)] for b in reads if id(b) in var_of],
                             outputs=[var_of[id(b)] for b in writes if id(b) in var_of],
                             name=name)
        return seq, var_of, persistent, transient

    def _persistent_modes(self):
        """The persistent modes a plan tries, in order (``"auto"``: resident if it fits)."""
        return ["resident", "swap"] if self.persistent == "auto" else [self.persistent]

    def _plan(self, seq):
        """``(schedule, error)``: the schedule of the first persistent mode that fits the
        budget (with recompute where it moves fewer bytes), else None and the last
        ScheduleError. Sets ``_rc_chain`` and, with recompute, ``_recompute_reason``."""
        from vmalloc.offload.scheduling.schedule import ScheduleError

        self._rc_chain = {}
        schedule = error = None
        for mode in self._persistent_modes():
            scheduler = None
            try:
                scheduler = self._make_scheduler(mode)
                schedule = scheduler.schedule(seq)
                # LMS and vDNN take no budget: their plans are checked for the rules only
                # (on demand, eviction keeps the budget around them).
                budgetless = self._scheduler_spec in ("lms", "vdnn")
                schedule.check(seq, None if budgetless or self.budget is None
                               else self.budget - self.schedule_margin)
                error = None
            except ScheduleError as e:
                # This budget cannot be scheduled (so): run on demand, which evicts as needed.
                # (Kept without its traceback: its frames hold this runtime, a reference cycle.)
                schedule, error = None, e.with_traceback(None)
            if self.recompute:
                self._recompute_reason = None
                if self.budget is None or (schedule is not None
                                           and schedule.swap_out_bytes(seq) == 0):
                    self._recompute_reason = "no budget pressure: nothing is swapped"
                elif scheduler is None:    # (the scheduler itself could not be made)
                    self._recompute_reason = "no schedule with recompute fits the budget"
                else:
                    # Recompute instead of swapping where it moves fewer bytes (or fits).
                    rc = self._recompute_plan(seq, scheduler, schedule)
                    if rc is not None:
                        schedule, error = rc, None
            if schedule is not None:
                break
        return schedule, error

    def _unschedulable(self, seq, error):
        """Says (once) that no schedule fits; raises under ``strict``."""
        from vmalloc.offload.scheduling.schedule import ScheduleError

        named = getattr(error, "function", None)
        need = getattr(error, "needed_bytes", None)
        if named is not None and 0 <= named < len(seq.functions) and need is None:
            # The scheduler names the function it failed at: the message names that one only
            # (another, "the largest", beside it read as two culprits).
            fn = named
            message = (f"no schedule fits the budget of {self.budget} bytes: {error}. "
                       "Iterations run on demand and may exceed the budget")
        else:
            if named is not None and 0 <= named < len(seq.functions):
                fn = named     # with the bytes the scheduler counted for it
            else:
                fn, need = _largest_function(seq)
            where = (f"function {fn} ({seq.functions[fn].name}) needs {need} bytes at once"
                     if fn is not None else "the iteration has no function")
            message = (f"no schedule fits the budget of {self.budget} bytes: {where}. The "
                       f"scheduler said: {error}. Iterations run on demand and may exceed "
                       "the budget")
        self._schedule_error = message
        self._schedule_need = (seq.functions[fn].name if fn is not None else None, need)
        if self.strict:
            raise ScheduleError(message, function=fn)
        self.say_budget(message)

    def _make_scheduler(self, persistent):
        spec = self._scheduler_spec
        if hasattr(spec, "schedule"):
            return spec
        from vmalloc.offload.scheduling.schedulers import make_scheduler
        if spec == "none" or (spec == "window" and self.budget is None):
            # No budget (a backend without a device, and none given): nothing need swap.
            return make_scheduler("none")
        if spec == "window":
            budget = self.budget - self.schedule_margin
            return make_scheduler("window", window=self.window or budget,
                                  budget=budget, persistent=persistent)
        return make_scheduler(spec)

    def keep_free(self, margin: int) -> bool:
        """Plans again from the same record with ``margin`` bytes of the budget kept free (a
        driver that replays the plan at coarser points holds some bytes longer: the PyTorch
        driver's steady state under pressure). Only when a window schedule fits the smaller
        budget: else nothing changes and False is returned (nothing said: the budget itself
        is still kept by the plan that stands)."""
        if (self._scheduler_spec != "window" or self._sequence is None or self.budget is None
                or not 0 < margin < self.budget):
            return False
        old, self.schedule_margin = self.schedule_margin, margin
        if self._build_schedule(keep_old=True):
            return True
        self.schedule_margin = old
        return False

def _largest_function(seq):
    """(index, device bytes) of the function whose distinct variables take the most bytes:
    no budget below it can run that function."""
    best, need = None, 0
    for i, f in enumerate(seq.functions):
        n = sum(seq.variables[v].nbytes for v in set(f.inputs) | set(f.outputs))
        if best is None or n > need:
            best, need = i, n
    return best, need
