"""The steady state under memory pressure of the PyTorch out-of-core driver: once an iteration
that swaps has been followed under the dispatch mode (the *probation*), the mode is popped and
the swaps that iteration made are replayed at a few boundaries PyTorch offers without a
dispatch mode, instead of at every aten op.

Why (measured, docs/benchmarks.md): under half of the TransformerEncoder's memory the dispatch
path cost 5.3-5.7x plain PyTorch, and a profile of its steps put nearly all of it in entering
Python for each of its ~1,800 aten ops per step (the mode, argument walks, predictions, the
runtime's bookkeeping for ~300 functions) and only a few percent in the swaps themselves
(~50 swap-outs of 6.4 MB a step). The boundaries, one Python call each:

- saved-tensor hooks (``torch.autograd.graph``): *pack*, after the forward op that saves a
  tensor; *unpack*, just before the backward node that reads it;
- global module forward pre- and post-hooks;
- ``Tensor.register_post_accumulate_grad_hook`` on the optimizers' parameters (a gradient was
  accumulated) and a global optimizer step pre-hook.

In the probation every swap the runtime makes (through a logging proxy of the backend) is
noted with the number of boundaries seen before it, and each storage with the boundary that
exposed it (a saved tensor packed, a gradient accumulated; parameters and optimizer state are
known). A swap-out is replayed at the first boundary after it, its swap-in at the last one
before it, which brackets the interval the storage was out in the probation, so nothing reads
it while it is out as long as the iteration repeats; a pair with no boundary between stays
resident. That costs bytes: each boundary gap's bytes in the probation (sampled after every
op) plus what the replay keeps longer is an upper bound of the device bytes, and the steady
state is entered only when that bound fits the budget (else the dispatch path stays, and
``stats()`` says why: ``pressure_refused``).

Every boundary is compared, in order, with the probation's (the module's class and argument
shapes, the saved tensor's shape and dtype, which parameter, which saved tensor); a difference
brings every storage back, pushes the mode again and records anew (as in
:mod:`vmalloc.frameworks.torch_steady`, said once in ``stats()``).
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref

from vmalloc.frameworks.torch_pressure_boundaries import (GRAD, OP, PACK, POST, STEP, UNPACK,
                                                          Logging, light_mode, pre_key,
                                                          tensors_of)
from vmalloc.frameworks.torch_pressure_replay import Replay


#: Plans made again with room kept for the replay before the dispatch path stays (each costs
#: one more probation iteration).
MAX_REPLANS = 2


class Pressure(Replay):
    """Records the probation's boundaries and swaps, plans, and replays them (module docs)."""

    def __init__(self, steady):
        self.steady = weakref.proxy(steady)   # (it holds this: no reference cycle)
        self.driver = steady.driver           # (a weak proxy too)
        self.probing = False
        self.active = False
        self.keys = []          # the probation's boundary keys, in order
        self.handles = []
        self.saved = None       # the saved-tensor hooks' context, while installed
        self.step_mode = None   # the optimizer step's op boundaries, while it runs
        self.halted = None      # a divergence found inside the step: said at its end
        self.refused = None     # why the last plan was not taken (stats)
        self.counts = dict(pressure_iterations=0, pressure_swap_outs=0, pressure_swap_ins=0,
                           pressure_peak_bound=0, pressure_replans=0, pressure_margin=0,
                           pressure_boundaries=0)
        self.dropped = frozenset()   # the boundary kinds the steady state's plan leaves out
        self.deferred = False        # swap-outs waited for at the next work boundary
        self.pending = []

    # --- hooks ----------------------------------------------------------------------------
    def _install(self, hooks=None):
        """The boundaries' hooks: the probation's (``hooks`` None: they record too), or the
        steady state's (:class:`~vmalloc.frameworks.torch_pressure_hooks.Hooks`)."""
        import functools

        import torch
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self.thread = threading.get_ident()
        self.params = [p for p in self.driver._persistent_tensors() if p.requires_grad]
        pre, post, grad, pack, unpack = (
            (self._pre, self._post, self._grad, self._pack, self._unpack) if hooks is None else
            (hooks.pre, hooks.post, hooks.grad, hooks.pack, hooks.unpack))
        self.handles = [register_module_forward_pre_hook(pre),
                        register_optimizer_step_pre_hook(self._step)]
        if hooks is None or POST not in self.dropped:
            self.handles.append(register_module_forward_hook(post))
        for i, p in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(functools.partial(grad, i)))
        self.saved = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.saved.__enter__()

    def _uninstall(self):
        self.stepped()
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.saved is not None:
            self.saved.__exit__(None, None, None)
            self.saved = None

    def _pre(self, module, args):
        if threading.get_ident() == self.thread:
            self._event(pre_key(module, args), args)
            self.steady.running = True

    def _post(self, module, args, out):
        if threading.get_ident() == self.thread:
            self._event((POST, type(module)), out)

    def _step(self, opt, args, kwargs):
        if threading.get_ident() == self.thread:
            self._event((STEP,))
            if (self.probing or self.active) and self.step_mode is None:
                self.step_mode = light_mode(self.hooks.op if self.active else
                                            lambda func: self._event((OP, func)))
                self.step_mode.__enter__()

    def stepped(self):
        """An optimizer's step returned (the driver's post-hook): its op boundaries end."""
        if self.step_mode is not None:
            mode, self.step_mode = self.step_mode, None
            mode.__exit__(None, None, None)

    def _grad(self, i, p):
        if threading.get_ident() == self.thread:
            self._event((GRAD, i), p.grad)

    def _pack(self, t):
        # A detached alias (same storage, same version counter): the tensor itself would make
        # a saved output keep its own node alive in a cycle the garbage collector never frees
        # when no backward runs; its version is checked at unpack, as autograd does.
        if threading.get_ident() != self.thread:
            return (None, t.detach(), t._version)
        j = self.n
        self._event((PACK, t.shape, t.dtype), t)
        return (j, t.detach(), t._version)

    def _unpack(self, handle):
        j, t, version = handle
        if t._version != version:
            self._modified(t, version)
        if j is not None and threading.get_ident() == self.thread:
            # (a storage may still be out here: a node unpacks all it saved before its first
            # op, and the plan brings each back at the last boundary before its first use)
            self._event((UNPACK, j))
        return t

    @staticmethod
    def _modified(t, version):
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a saved tensor of shape {list(t.shape)} is at version "
            f"{t._version}; expected version {version} instead (checked by "
            "vmalloc.torch.out_of_core's saved-tensor hooks, as autograd does)")

    # --- probation ------------------------------------------------------------------------
    def arm(self):
        """The next iteration is the probation: its boundaries and swaps are noted."""
        rt = self.driver.runtime
        self.probing, self.keys, self.n = True, [], 0
        self.exposed = {}       # buffer id -> the slots that exposed it, in order
        self.log = []           # (gap, "out"/"in", buffer id or persistent slot, nbytes, time)
        self.samples = []       # (time, device bytes) after each op and at each boundary
        self.times = []         # each boundary's time (times count samples and swaps)
        self.uses = {}          # buffer id or persistent slot -> the times ops used it
        self.foreign = None     # why the boundaries cannot see what the iteration saved
        self._backend = rt.swap
        rt.swap = Logging(rt.swap, self._note)
        self._install()

    def disarm(self):
        if self.probing:
            self.driver.runtime.swap = self._backend
            self.probing = False
            self._uninstall()

    def sample(self, used=()):
        """After an op of the probation (the driver's ``_run``, with the buffers it read or
        wrote): its device bytes, and when each buffer was used."""
        t = self._now()
        self.samples.append((t, self.driver.runtime._device_bytes))
        for buf in used:
            self.uses.setdefault(("persistent", buf.ptr) if buf.persistent else buf.id,
                                 []).append(t)

    def _note(self, what, ptr):
        entry = self.driver._storages.by_ptr.get(ptr)
        if entry is None:
            if what == "wait":
                return      # (a storage freed meanwhile: its bytes are no one's)
            self.log.append((self.n, what, None, 0, self._now()))
            return
        buf = entry[0]
        slot = ("persistent", ptr) if buf.persistent else buf.id
        self.log.append((self.n, what, slot, buf.nbytes, self._now()))

    def _now(self):
        return len(self.log) + len(self.samples)

    def plan(self):
        """At the probation's end: the replay, if its bound fits the budget (else False and
        ``refused`` says why)."""
        from vmalloc.frameworks.torch_pressure_plan import Probation, make_plan
        self.disarm()
        # An asynchronous backend's swap-outs waited for late if that fits (else each at
        # once: a GPU's queue drained at every swap-out), then the fewest boundaries: without
        # the module post-hooks if that fits.
        asynchronous = bool(getattr(self.driver.backend, "asynchronous", False))
        for deferred, drop in itertools.product((True, False) if asynchronous else (False,),
                                                (frozenset([POST]), frozenset())):
            seen = Probation(self, drop, deferred)
            plan, why = make_plan(seen)
            if plan is not None:
                break
        self.excess = seen.excess
        self.refused = why
        if plan is None:
            self._keep_room()
            return False
        self.keys, self.dropped, self.deferred = seen.keys, drop, seen.deferred
        self.counts["pressure_boundaries"] = len(self.keys)
        self.actions, slots, self.cycle, bound = plan
        self.slots = {}         # boundary -> positions of the tensors it binds
        for slot in sorted(slots):
            self.slots.setdefault(slot >> 16, []).append(slot & 0xFFFF)
        # The boundaries where the replay binds or swaps (those at the iteration's end are
        # made by boundary()).
        self.work = frozenset(self.slots) | frozenset(
            i for i in self.actions if i < len(self.keys))
        self.counts["pressure_peak_bound"] = max(self.counts["pressure_peak_bound"], bound)
        return True

    def _keep_room(self):
        """A replay over the budget by ``excess`` bytes: the runtime plans again with that much
        of the budget kept free (at most MAX_REPLANS times), and the next iteration is a new
        probation of that plan (said: ``pressure_margin``, and ``pressure_refused`` while no
        plan fits)."""
        rt = self.driver.runtime
        if not self.excess or self.counts["pressure_replans"] >= MAX_REPLANS:
            return
        margin = rt.schedule_margin + self.excess
        if rt.keep_free(margin):
            self.counts["pressure_replans"] += 1
            self.counts["pressure_margin"] = margin

    # --- boundaries (the probation's, and the steady state's general path) ---------------
    def _event(self, key, exposes=None):
        """Boundary i, with what it exposes (a tensor, or a module's arguments or output:
        their tensors, one level deep): slot ``i << 16 | k`` names the storage of its k-th
        tensor."""
        i = self.n
        self.n = i + 1
        if self.probing:
            self.keys.append(key)
            self.times.append(self._now())
            self.sample()
            torch = sys.modules["torch"]
            for k, tensor in enumerate(tensors_of(exposes)):
                if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or \
                        tensor.layout != torch.strided:
                    # A subclass (a wrapper, a FakeTensor while torch.compile traces) or a
                    # sparse tensor: what it holds is not a storage the replay can swap.
                    if key[0] == PACK:
                        self.foreign = (f"a {type(tensor).__name__} ({tensor.layout}) was "
                                        "saved: its storages are not seen at a boundary")
                    continue
                buf = self.driver._storages.known(tensor.untyped_storage())
                if buf is not None:
                    self.exposed.setdefault(buf.id, []).append(i << 16 | k)
            return
        if not self.active or self.halted is not None:
            return
        if i >= len(self.keys) or self.keys[i] != key:
            self._diverged(i, key)
        elif i in self.work:
            self._hit(i, exposes)
