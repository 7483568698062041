"""The replay of the steady state under pressure (:mod:`vmalloc.frameworks.torch_pressure`):
the plan's swaps made at the boundaries, storages bound where a boundary exposes them, a
divergence brought back to the dispatch path, and every storage back where the runtime has it
at each iteration's end. :class:`~vmalloc.frameworks.torch_pressure.Pressure` records the
probation and plans; this half follows the plan (one concept per file: the Pressure's state
is shared, as the Runtime's mixins share theirs)."""

from __future__ import annotations

import sys
import threading
import weakref

from vmalloc.frameworks.torch_pressure_boundaries import tensors_of
from vmalloc.frameworks.torch_swap import _live


class Replay:
    """The steady state's half of :class:`~vmalloc.frameworks.torch_pressure.Pressure`."""

    def start(self):
        """The steady state begins (the plan taken): the replay's hooks installed."""
        self.active = True
        self.n = 0
        self.bound = {}         # slot -> storage, this iteration
        self.out = {}           # slot -> ptr, swapped out by the replay
        self.out_ptrs = {}      # ptr -> slot
        self.dead = []
        self.pending = []       # ptrs swapping out, waited for at the next work boundary
        for slot in self.cycle:       # out as the probation left them
            if self.driver.backend.state(slot[1]) != "resident":
                self.out[slot] = slot[1]
                self.out_ptrs[slot[1]] = slot
        from vmalloc.frameworks.torch_pressure_hooks import Hooks
        self.thread = threading.get_ident()   # (the hooks capture it: this thread's iteration)
        self.hooks = Hooks(self)
        self._install(self.hooks)

    def _diverged(self, i, key):
        """Boundary i is not the record's: every storage back, the dispatch path again."""
        what = ("more boundaries than" if i >= len(self.keys)
                else f"boundary {i} differs from")
        why = f"steady state under pressure: {what} the record"
        if self.step_mode is None and sys.modules["torch"]._C._current_graph_task_id() < 0:
            self.steady.leave(why, now=True)
        else:
            # Inside the step's own mode, which cannot be popped from its handler, or inside
            # autograd's backward, whose end restores the dispatch modes of its start (a mode
            # pushed here would be gone): all back now, the rest of the iteration plain, the
            # dispatch path from its end.
            self.restore(everything=True)
            self.halted = why

    def _hit(self, i, exposes):
        """Boundary i, where the plan binds a storage or swaps."""
        if self.pending:
            self._settle()
        if self.dead:
            self._collect()
        if self.driver._storages.dead:
            # Freed since: the runtime forgets them (a host copy of one freed while out is
            # dropped) before PyTorch's next storage at that address is swapped.
            self.driver._storages.collect()
        binds = self.slots.get(i)
        if binds is not None:
            tensors = tensors_of(exposes)
            for k in binds:
                if k >= len(tensors):
                    continue      # (not there: its swaps are skipped, nothing read out)
                s = tensors[k].untyped_storage()
                slot = i << 16 | k
                # Weak: the replay must not keep alive what the program frees.
                self.bound[slot] = weakref.ref(s, lambda r, slot=slot: self.dead.append(slot))
                self.driver.backend.register(s.data_ptr(), s)
        acts = self.actions.get(i)
        if acts:
            self._act(acts)

    def _act(self, acts):
        for what, slot in acts:
            if isinstance(slot, tuple):
                s = self._persistent(slot)
            else:
                ref = self.bound.get(slot)
                s = ref() if ref is not None else None
            if s is None:
                continue
            ptr = s.data_ptr()
            if what == "out":
                if slot in self.out:
                    continue
                # (deferred: the copy overlaps the ops up to the next working boundary)
                self._take_out(slot, ptr, defer=self.deferred)
                self.counts["pressure_swap_outs"] += 1
            elif slot in self.out:
                self._bring_back(ptr)
                self.counts["pressure_swap_ins"] += 1

    def _take_out(self, slot, ptr, defer=False):
        """Swaps the storage at ptr out, waited for now or (``defer``) at the next working
        boundary, and notes it out."""
        backend = self.driver.backend
        backend.swap_out(ptr)
        if defer:
            self.pending.append(ptr)
        else:
            backend.wait(ptr)
        self.out[slot] = ptr
        self.out_ptrs[ptr] = slot

    def _settle(self):
        """The deferred swap-outs waited for (an asynchronous backend: the host waits for
        each copy, and its device memory is released; one brought back meanwhile is not
        swapping out any more)."""
        pending, self.pending = self.pending, []
        backend = self.driver.backend
        for ptr in pending:
            if backend.state(ptr) == "swapping_out":
                backend.wait(ptr)

    def _persistent(self, slot):
        entry = self.driver._storages.by_ptr.get(slot[1])
        return None if entry is None else _live(entry[1])

    def _bring_back(self, ptr):
        backend = self.driver.backend
        slot = self.out_ptrs.pop(ptr)
        del self.out[slot]
        backend.swap_in(ptr)
        if backend.state(ptr) == "swapping_in":
            backend.wait(ptr)

    def _collect(self):
        """Storages PyTorch freed: a host copy of one freed while out is dropped."""
        dead, self.dead = self.dead, []
        for slot in dead:
            self.bound.pop(slot, None)
            ptr = self.out.pop(slot, None)
            if ptr is not None:
                del self.out_ptrs[ptr]
                self.driver.backend.discard(ptr)

    def boundary(self):
        """An iteration's end: the reason it diverged, or None. Its swap-outs at the end are
        made; what else is out comes back (restore)."""
        n, self.n = self.n, 0
        self.counts["pressure_iterations"] += 1
        halted, self.halted = self.halted, None
        if halted is not None:
            self.bound = {}
            return halted       # (everything came back when it was found)
        if n == len(self.keys) and n in self.actions:
            self._act(self.actions[n])
        self.restore()          # (which first waits for what is pending)
        self.bound = {}
        if n != len(self.keys):
            return (f"steady state under pressure: the iteration passed {n} boundaries; the "
                    f"record passed {len(self.keys)}")
        return None

    def restore(self, everything=False):
        """Every storage back where the runtime has it: transient ones resident, persistent
        ones as the runtime left them at the probation's end (divergence, the block's end,
        each iteration's end)."""
        if self.pending:
            self._settle()
        if self.dead:
            self._collect()
        backend = self.driver.backend
        for ptr, slot in list(self.out_ptrs.items()):
            if everything or not isinstance(slot, tuple):
                self._bring_back(ptr)
        if everything:
            return      # (the runtime's view is restored when the mode comes back)
        by_ptr = self.driver._storages.by_ptr
        for slot in self.cycle:
            ptr = slot[1]
            entry = by_ptr.get(ptr)
            if entry is None:
                continue
            if entry[0].where == "resident":
                if slot in self.out:
                    self._bring_back(ptr)
            elif slot not in self.out and backend.state(ptr) == "resident":
                self._take_out(slot, ptr)

    def reads(self, tensors):
        """Whether reading ``tensors`` outside an op (None: every storage) would read one the
        replay or the runtime holds out."""
        if tensors is None:
            return bool(self.out)
        from vmalloc.frameworks.torch_subclass import plain_tensors
        strided = sys.modules["torch"].strided
        return any(t.layout == strided and t.untyped_storage().data_ptr() in self.out_ptrs
                   for t in plain_tensors(tensors))

    def stop(self):
        """Back to the dispatch path: every storage where the runtime has it."""
        if self.active:
            self.restore()
            self.out, self.out_ptrs = {}, {}
            self.active = False
            self.halted = None
            self._uninstall()
            self.bound = {}
            self.hooks = None     # (its closures hold this: no cycle once the replay stops)
