"""Recompute, executed: a buffer the schedule recomputes is *dropped* (its device memory
released, no copy) after its last use before a long gap, and *recomputed* before its next use by
re-running the functions that wrote it (its chain: the producer, then any in-place writers) on
their inputs, which the schedule keeps (the planner's rule: inputs are read again at or after the
recompute point, and nothing writes them in between).

A driver makes a function recomputable by giving ``rerun`` to :meth:`Runtime.enter_function`
(or by :meth:`Runtime.call`, or :meth:`Runtime.set_rerun` once the function ran): a callable
that, given the function's pointers, reads its inputs and writes its output again, exactly as
the function did (it may have a ``ready()`` method saying whether it still can). Only functions with one output and a
``rerun`` in every iteration form chains; only pointer-stable buffers (the virtual allocator's
chunk path: ``unmap_backing`` / ``map_backing``, or a swap backend with ``release`` /
``rematerialize``) are dropped.

No data lost: the runtime keeps the invariant that a dropped buffer's chain inputs are alive and
unchanged. Before a function writes one, before one is freed or forgotten, and whenever the
dropped buffer itself is needed (a function lists it, ``restore_all``, a ``forget`` that keeps
the memory), the buffer is recomputed first, on demand. So a program that departs from its
record (a divergence, a failure) still reads the right bytes.

A recompute is all or nothing: the buffer stays dropped (its record, its inputs' guards) until
its chain has run; a failure on the way releases what was mapped for it and raises
:class:`RecomputeError`, the buffer still dropped and recomputable (docs/runtime.rst).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

from vmalloc.errors import InvalidArgumentError, VmallocError
from vmalloc.offload.runtime.buffers import Buffer, FunctionPointers


class RecomputeError(VmallocError, RuntimeError):
    """A dropped buffer could not be recomputed (its memory could not be mapped, an input could
    not come back, its ``rerun`` raised): the message names the buffer and the cause. The
    buffer stays dropped, nothing it held is lost (it held nothing), and the next read tries
    again."""


class Recomputation:
    """The recompute half of :class:`~vmalloc.offload.Runtime` (a mixin)."""

    # --- the protocol's part: how a function says how to redo itself ---------------------------
    def call(self, fn, reads: Iterable[Buffer] = (), writes: Iterable[Buffer] = (),
             name: Optional[str] = None):
        """Runs ``fn(ptrs)`` as one function (``ptrs`` as :meth:`function` yields them) and
        returns its result. ``fn`` is also the function's ``rerun``: with ``recompute=True``
        the runtime may call it again to recompute what it wrote, so it must read only
        ``reads``, write only ``writes``, and give the same bytes for the same inputs."""
        ptrs = self.enter_function(reads, writes, name, rerun=fn)
        try:
            out = fn(ptrs)
        except BaseException:
            self.exit_function(failed=True)
            raise
        self.exit_function()
        return out

    def set_rerun(self, rerun) -> None:
        """The running function's ``rerun`` (see :meth:`enter_function`), for a driver that
        learns how to redo the function only once it ran (its outputs, added by
        :meth:`add_writes`, are then part of the rerun's pointers)."""
        if not self._in_function:
            raise InvalidArgumentError("set_rerun is for the running function")
        if rerun is not None and not callable(rerun):
            raise InvalidArgumentError(f"rerun must be callable, got {rerun!r}")
        self._fn_rerun = rerun

    # --- planning (after a recorded iteration) ------------------------------------------------
    def _recompute_plan(self, seq, scheduler, base):
        """A schedule of ``seq`` with recompute when it fits the budget and moves fewer bytes
        than ``base`` (None when ``base`` failed), else None."""
        from vmalloc.offload.scheduling.recompute import recompute_candidates, with_recompute
        from vmalloc.offload.scheduling.schedule import ScheduleError

        fns = seq.functions
        rerunnable = self._record_rerunnable
        droppable = self._droppable_nbytes
        seen = {"gap": False, "chain": False, "droppable": False}   # (recompute_reason)

        def eligible(v, chain):
            seen["gap"] = True
            ok = all(c in rerunnable and set(fns[c].outputs) == {v} for c in chain)
            seen["chain"] = seen["chain"] or ok
            ok = ok and v not in self._rc_excluded and droppable(seq.variables[v].nbytes)
            seen["droppable"] = seen["droppable"] or ok
            return ok

        variables = recompute_candidates(seq, self._recompute_gpu, eligible=eligible)
        if not variables:
            self._recompute_reason = self._rc_refusal if self._rc_excluded else (
                "no function with a rerun (Runtime.call, or enter_function's rerun)"
                if not rerunnable else
                "no buffer goes unused long enough between its uses to be dropped"
                if not seen["gap"] else
                "no function with a rerun writes a buffer alone" if not seen["chain"] else
                "no buffer a rerun writes can be dropped (released and mapped again at its "
                "address)" if not seen["droppable"] else
                "nothing is cheaper to recompute than its swap")
            return None
        rc = with_recompute(seq, variables)
        try:
            sched = scheduler.schedule(rc.sequence)
            sched.recompute = rc
            sched.check(seq, self.budget)
        except ScheduleError:
            self._recompute_reason = "no schedule with recompute fits the budget"
            return None       # the plain plan (or on demand) stands
        if base is not None and sched.swap_out_bytes(seq) >= base.swap_out_bytes(seq):
            self._recompute_reason = "nothing is cheaper to recompute than its swap"
            return None
        chains = seq._recompute_chains[2]
        self._rc_chain = {v: chains[v][0] for v in variables}
        return sched

    def _droppable_nbytes(self, nbytes) -> bool:
        """Whether a buffer of nbytes can be dropped and mapped again at its own address."""
        if hasattr(self.swap, "release") and hasattr(self.swap, "rematerialize"):
            return True
        a = self.allocator
        return (a is not None and hasattr(a, "unmap_backing")
                and getattr(a, "placement", "chunks") == "chunks"
                and nbytes > getattr(a, "small_threshold", 0))

    # --- following: inserted functions and drops ------------------------------------------------
    def _run_inserted(self, k):
        """Expanded function k re-runs a recorded one: the producer's step recomputes a dropped
        buffer (its whole chain); the in-place members' steps were done with it."""
        rc = self._schedule.recompute
        v = rc.clones[rc.sequence.functions[k].outputs[0]]
        if rc.origin[k] != self._rc_chain[v][0]:
            return
        buf = self._buf_of_var.get(v)
        if buf is not None and buf.alive and buf.where == "dropped":
            self._recompute_now(buf)

    def _drop_for_recompute(self, v):
        """The schedule frees recorded variable v, which it recomputes later: release its
        buffer's device memory with no copy, remembering this iteration's chain to re-run. A
        buffer that cannot be recomputed safely (a function of its chain ran without
        ``rerun``, an input is gone) stays resident."""
        buf = self._buf_of_var.get(v)
        if buf is None or not buf.alive or buf.where != "resident" or not buf.movable:
            return
        chain = []
        for c in self._rc_chain[v]:
            entry = self._iter_reruns.get(c)
            if entry is None:
                return self._refuse(v, "a function of its chain ran without a rerun")
            if any(not b.alive for b in entry[1] + entry[2]):
                return self._refuse(v, "an input of its function was freed before the rerun")
            ready = getattr(entry[0], "ready", None)   # a driver's rerun may say it cannot
            if ready is not None and not ready():
                return self._refuse(v, "its function's rerun cannot run (an input or its "
                                       "output is gone)")
            chain.append(entry)
        inputs = {b.id for _, reads, _ in chain for b in reads if b is not buf}
        if any(self._buffers[i].where == "dropped" for i in inputs):
            return self._refuse(v, "an input of its function is itself dropped")
        if not self._release(buf):
            return self._refuse(v, "its memory cannot be released at its address")
        self._dropped[buf.id] = (chain, inputs)
        for i in inputs:
            self._dependents.setdefault(i, set()).add(buf.id)
        self._stats["recompute_drops"] += 1

    def _refuse(self, v, cause):
        """A planned drop the runtime cannot follow: the buffer stays resident (the plan's
        budget no longer holds around it), and the plan is made again without it when the
        iteration ends (:meth:`_replan_refused`)."""
        self._rc_refused.setdefault(v, cause)
        self._stats["recompute_refused"] += 1

    def _replan_refused(self):
        """End of a followed iteration that refused planned drops: plans again from the same
        record, those variables no longer candidates; said once (a warning, and
        ``recompute_reason`` while the new plan stands)."""
        from vmalloc.offload.runtime.recording import warn_user

        refused, self._rc_refused = self._rc_refused, {}
        if not refused:
            return
        self._rc_excluded |= set(refused)
        causes = "; ".join(sorted(set(refused.values())))
        self._rc_refusal = (f"{len(refused)} planned drop(s) could not be followed ({causes}): "
                            f"planned again without them")
        warned = self._warned_recompute
        self._build_schedule()     # (says "recomputes nothing" if nothing is left)
        if self._recompute_reason is None:
            self._recompute_reason = self._rc_refusal
        if not self._warned_refusal and warned == self._warned_recompute:
            warn_user(f"recompute=True: {self._rc_refusal}", UserWarning)
        # Said once: a later re-plan (the next candidate refused too) says nothing more,
        # neither does a plan that is then left with nothing to recompute.
        self._warned_refusal = self._warned_recompute = True

    # --- the two memory primitives --------------------------------------------------------------
    def _release(self, buf) -> bool:
        """Device memory of a resident buffer released, no copy: resident -> dropped."""
        if hasattr(self.swap, "release"):
            self.swap.release(buf.key, stream=self.stream)
        else:
            a = self.allocator
            try:
                if not a.owns_chunks(buf.ptr):
                    return False
            except VmallocError:
                return False
            a.unmap_backing(buf.ptr, stream=self.stream)
        self._untrack(buf)
        buf.where = "dropped"
        return True

    def _rematerialize(self, buf):
        """Device memory for a dropped buffer at its own address (contents undefined), making
        room under the budget as an allocation does. The buffer stays dropped (out of the
        eviction order, counted in the device bytes) until its recompute succeeds."""
        if hasattr(self.swap, "rematerialize"):
            self._with_room(buf.footprint,
                            lambda: self.swap.rematerialize(buf.key, stream=self.stream))
        else:
            self._with_room(buf.footprint,
                            lambda: self.allocator.map_backing(buf.ptr, stream=self.stream))
        self._rc_backed.add(buf.id)
        self._device_bytes += buf.footprint
        self._peak_device_bytes = max(self._peak_device_bytes, self._device_bytes)

    def _unback(self, buf):
        """Rolls a failed recompute back: the memory mapped for it released again. Returns
        why that failed (the memory then stays mapped, counted, and is reused by the next
        try), or None."""
        if buf.id not in self._rc_backed:
            return None
        try:
            if hasattr(self.swap, "release"):
                self.swap.release(buf.key, stream=self.stream)
            else:
                self.allocator.unmap_backing(buf.ptr, stream=self.stream)
        except Exception as error:  # noqa: BLE001 - said in the RecomputeError
            return error
        self._forget_backing(buf)
        return None

    def _forget_backing(self, buf):
        if buf.id in self._rc_backed:
            self._rc_backed.discard(buf.id)
            self._device_bytes -= buf.footprint

    # --- on demand: the invariant -------------------------------------------------------------
    def _recompute_now(self, buf):
        """Recomputes a dropped buffer: its memory back, its chain re-run on its inputs (made
        resident on demand), none of which changed since the chain ran.

        Transactional: the buffer stays dropped (its record and its inputs' guards kept) until
        every function of its chain has run; any failure on the way (memory, an input that
        cannot come back, a rerun that raises) releases what was mapped for it and raises one
        :class:`RecomputeError`, the buffer still dropped and recomputable."""
        chain, _ = self._dropped[buf.id]
        for rerun, _, _ in chain:
            ready = getattr(rerun, "ready", None)    # its inputs gone: touch nothing
            if ready is not None and not ready():
                raise RecomputeError(f"buffer {buf.id} could not be recomputed: its "
                                     f"function's rerun cannot run (an input or its output "
                                     f"is gone); it stays dropped")
        saved = self._current
        doing = "mapping its memory again"
        try:
            if buf.id not in self._rc_backed:    # (mapped already if a rollback failed)
                self._rematerialize(buf)
            for rerun, reads, writes in chain:
                others = [b for b in dict.fromkeys(reads + writes) if b is not buf]
                self._current = (saved or []) + [buf] + others   # none evicted meanwhile
                doing = "bringing back its function's inputs"
                self._make_resident(others)
                doing = "running its function's rerun"
                rerun(FunctionPointers(reads + writes))
        except Exception as error:
            kept = self._unback(buf)
            note = "" if kept is None else (f" (releasing the memory mapped for it failed "
                                             f"too, {kept!r}: it stays mapped for the next try)")
            kept = None    # (its traceback's frames hold this one: a reference cycle)
            raise RecomputeError(f"buffer {buf.id} could not be recomputed: {doing} raised "
                                 f"{error!r}; it stays dropped and is recomputed again when "
                                 f"next needed{note}") from error
        except BaseException:
            self._unback(buf)
            raise
        finally:
            self._current = saved
        # Its bytes are in place: only now is it resident, and its guards go.
        self._rc_backed.discard(buf.id)   # (first: its bytes stay counted, now as its own)
        self._take_dropped(buf)
        buf.where = "resident"
        self._lru[buf.id] = buf      # (its bytes were counted when mapped)
        self._stats["recomputed_functions"] += len(chain)

    def _before_writes(self, bufs):
        """A function is about to write ``bufs``: buffers recomputed from any of them are
        recomputed first (their inputs must not change while they are dropped)."""
        for b in bufs:
            for d in sorted(self._dependents.get(b.id, ())):
                dep = self._buffers.get(d)
                if dep is not None and dep.where == "dropped":
                    self._recompute_now(dep)

    def _before_free(self, buf, freed=False):
        """``buf`` leaves the runtime: what is recomputed from it is recomputed now; a dropped
        buffer itself has nothing left to keep. ``freed``: its owner freed it already (a
        framework's storage), so a dependent that cannot be recomputed any more stays dropped
        (reading it raises RecomputeError) instead of failing the free."""
        if freed:
            for d in sorted(self._dependents.get(buf.id, ())):
                dep = self._buffers.get(d)
                if dep is not None and dep.where == "dropped":
                    try:
                        self._recompute_now(dep)
                    except RecomputeError:
                        pass    # said when it is read
            self._dependents.pop(buf.id, None)
        else:
            self._before_writes([buf])
        if buf.where == "dropped":
            self._take_dropped(buf)

    def _take_dropped(self, buf):
        """Forgets what dropped ``buf`` remembers (its inputs no longer guard it, memory a
        failed rollback left mapped is no longer counted as its own); returns its chain."""
        self._forget_backing(buf)
        chain, inputs = self._dropped.pop(buf.id)
        for i in inputs:
            deps = self._dependents.get(i)
            if deps is not None:
                deps.discard(buf.id)
                if not deps:
                    del self._dependents[i]
        return chain

    def _recompute_all(self):
        """Every dropped buffer recomputed; one that cannot be stays dropped, the others are
        still tried, and the first failure is raised."""
        first = None
        for bid in list(self._dropped):
            buf = self._buffers.get(bid)
            if buf is not None and buf.where == "dropped":
                try:
                    self._recompute_now(buf)
                except RecomputeError as error:
                    first = first or error
        if first is not None:
            try:
                raise first
            finally:
                first = None   # (this frame, in its traceback, would hold it: a cycle)


def init_recompute_state(rt, recompute, gpu):
    """The recompute fields of a new runtime (called by its constructor)."""
    if recompute not in (False, True):
        raise InvalidArgumentError(f"recompute must be True or False, got {recompute!r}")
    rt.recompute = bool(recompute)
    rt._recompute_gpu = gpu or "v100-16gb"
    rt._record_rerunnable: Set[int] = set()    # recorded function indices with a rerun
    rt._iter_reruns: Dict[int, Tuple] = {}     # this iteration: step -> (rerun, reads, writes)
    rt._rc_chain: Dict[int, List[int]] = {}    # recomputed variable -> its chain (steps)
    rt._dropped: Dict[int, Tuple] = {}         # buffer id -> (chain entries, input ids)
    rt._dependents: Dict[int, Set[int]] = {}   # input buffer id -> dropped buffer ids
    rt._rc_backed: Set[int] = set()            # dropped buffer ids whose memory is mapped
    rt._recompute_reason = None   # why the last plan recomputes nothing (recompute=True)
    rt._warned_recompute = False
    rt._rc_refused: Dict[int, str] = {}    # this iteration: variable -> why its drop was refused
    rt._rc_excluded: Set[int] = set()      # variables of this record no plan drops any more
    rt._rc_refusal = None
    rt._warned_refusal = False
