"""Following a schedule: at each function boundary of a scheduled iteration the runtime issues
the step's waits and swap-ins before the function and its swap-outs after it, keyed by the
variables of the record (each buffer of this iteration is matched to the recorded variable it
stands for). Under recompute the schedule's steps are those of the expanded sequence: before
the program's function i come the inserted functions that recompute dropped buffers
(``recompute``), and a variable the expanded sequence frees while the program still holds it is
dropped."""

from __future__ import annotations


class Following:
    """The schedule-following half of :class:`~vmalloc.offload.Runtime` (a mixin)."""

    def _enter_initial_state(self):
        """Persistent buffers where the schedule expects them when an iteration starts."""
        resident = self._schedule.initial_resident
        for buf in self._buffers.values():
            if not buf.persistent or buf.var is None or not buf.movable:
                continue
            if buf.var in resident and buf.where != "resident":
                self._swap_in(buf, on_demand=True)
                self._wait(buf)
            elif buf.var not in resident and buf.where in ("resident", "swapping_in"):
                self._wait(buf)
                self._out(buf)
                self._pending_out.append(buf)
        self._complete_swap_outs(list(self._pending_out))

    def _run_pre_actions(self):
        # The next step's actions before its function (waits for swap-outs, swap-ins) run at
        # the program's next allocate or function, not at the previous function's exit: the
        # program's frees in between come first, as the schedule's frees do.
        self._pre_pending = False
        if self._following:
            self._pre_actions(self._step)

    def _buf_of(self, v):
        """This iteration's buffer for variable v of the steps (a clone: its original's)."""
        rc = self._schedule.recompute
        if rc is not None:
            v = rc.clones.get(v, v)
        return self._buf_of_var.get(v)

    def _pre_actions(self, i):
        """Program function i's actions before it runs: under recompute, the inserted
        functions before it (each with its own actions), then its own."""
        rc = self._schedule.recompute
        if rc is not None:
            if i >= len(rc.index):
                return
            for k in range(rc.index[i - 1] + 1 if i else 0, rc.index[i]):
                self._step_pre(k)
                self._run_inserted(k)
                self._step_post(k)
            i = rc.index[i]
        self._step_pre(i)

    def _post_actions(self, i):
        rc = self._schedule.recompute
        self._step_post(rc.index[i] if rc is not None else i)

    def _step_pre(self, i):
        """Step i's actions before the function: wait for swap-outs, issue swap-ins."""
        if i >= len(self._schedule.steps):
            return
        step = self._schedule.steps[i]
        if not (step.wait_swap_out or step.swap_in):
            return
        vmap = self._buf_of
        waits = [b for b in map(vmap, step.wait_swap_out) if b is not None]
        self._complete_swap_outs(waits)
        for v in step.swap_in:
            buf = vmap(v)
            if buf is None or not buf.alive:
                continue
            if self._swap_in(buf, on_demand=False):
                if buf.where == "swapping_in":   # (a copy that landed already is resident)
                    self._pending_in.append(buf)
                self._stats["scheduled_swap_ins"] += 1
            else:
                self._stats["prefetch_failures"] += 1

    def _step_post(self, i):
        """Step i's swap-outs, after the function; under recompute, its drops."""
        step = self._schedule.steps[i]
        if self._rc_chain and step.free:
            for v in step.free:
                if v in self._rc_chain:
                    self._drop_for_recompute(v)
        if not step.swap_out:
            return
        vmap = self._buf_of
        for v in step.swap_out:
            buf = vmap(v)
            if buf is None or not buf.alive or not buf.movable:
                continue
            if buf.where == "swapping_in":
                self._wait(buf)
            if buf.where == "resident":
                self._out(buf)
                self._pending_out.append(buf)
                self._stats["scheduled_swap_outs"] += 1

    def _finish_following(self):
        """End of a scheduled iteration: outstanding swap-outs complete (the schedule's
        end_wait_swap_out), swap-ins too."""
        self._complete_swap_outs(list(self._pending_out))
        for buf in list(self._pending_in):
            if buf.alive:
                self._wait(buf)
        self._pending_in.clear()
        n = len(self._sequence.functions)
        if self._step != n:
            # Shorter than the record: the program changed.
            self._diverge(f"the iteration ended after {self._step} functions; the record "
                          f"has {n}")
