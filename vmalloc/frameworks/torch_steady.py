"""The steady state of :class:`~vmalloc.frameworks.torch_out_of_core.OutOfCore`: once the
recorded iteration repeats and its schedule moves nothing (no budget, or a budget it fits
without a swap or a recompute), the driver leaves PyTorch's dispatcher alone.

Why: a ``TorchDispatchMode`` enters Python for every aten op (tens of microseconds each, more
than the op itself on a GPU) and the budget's allocation pressure adds a meta-device
prediction per op. A schedule with no action needs neither, so after the iteration that
confirms it (the *probation* iteration: followed under the mode, without divergence) the mode
is popped and the driver's only Python work is

- a global module forward pre-hook (one call per ``nn.Module`` call, not per op) that
  compares each call, in order, with the probation iteration's: the module's class (not the
  object: BERT makes its loss module anew in every forward) and the shapes and dtypes of its
  tensor arguments;
- the optimizer step hook the driver has anyway (the iteration's boundary): there the
  number of calls is compared too.

A difference (a new batch shape, a data-dependent branch that calls other modules, a shorter
or longer iteration, a new optimizer, a storage resized outside the dispatcher) is a
divergence: the mode is pushed again at once (mid-iteration, from the pre-hook: the rest of
the iteration runs on demand under the budget) or at the boundary, and the next iteration is
recorded anew; the steady state resumes after the next quiet probation. What the steady state
cannot see it refuses: programs without ``nn.Module`` calls, collectives, compression,
wrapper subclasses, ``torch.compile``'d regions and a mode stack the driver's mode is not on
top of stay on the dispatch path (see docs/frameworks.rst, "The steady state").

A schedule that swaps has a steady state of its own, armed and entered from here:
:mod:`vmalloc.frameworks.torch_pressure` replays the probation's swaps at saved-tensor, module,
gradient and optimizer-step boundaries.
"""

from __future__ import annotations

import sys
import threading
import weakref

# The driver's ``stats()`` adds: ``steady_iterations`` (whole iterations run without the
# mode; counted in ``iterations`` and ``scheduled_iterations`` too, and in
# ``diverged_iterations`` when found diverged at their end), ``steady_exits`` (divergences
# found in the steady state), ``dispatched_ops`` and ``meta_predictions`` (aten ops the
# dispatch mode saw, and those run on the meta device: torch_predict).

#: Steady exits in a row after which the driver stops trying (a program that never repeats);
#: a steady stretch of STREAK iterations or more starts the count anew (a periodic evaluation).
MAX_EXITS = 3
STREAK = 8


def quiet(driver) -> bool:
    """Whether the runtime's schedule moves nothing and every tracked storage is resident."""
    rt = driver.runtime
    schedule = rt.schedule
    if schedule is None or getattr(schedule, "recompute", None) is not None:
        return False
    if getattr(schedule, "end_drop", None) or getattr(schedule, "compressed", None):
        return False
    for step in schedule.steps:
        if step.swap_out or step.swap_in or step.wait_swap_out or step.drop:
            return False
    return all(entry[0].state == "resident" for entry in driver._storages.by_ptr.values()
               if entry[0].alive)


def pressing(driver) -> bool:
    """Whether the schedule swaps and the steady state under pressure can replay it: no
    recompute, no compression, nothing dropped (:mod:`vmalloc.frameworks.torch_pressure`)."""
    schedule = driver.runtime.schedule
    if schedule is None or getattr(schedule, "recompute", None) is not None:
        return False
    if getattr(schedule, "end_drop", None) or getattr(schedule, "compressed", None):
        return False
    return hasattr(driver.backend, "register") and not quiet(driver)


class Steady:
    """The driver's steady state (see the module docs)."""

    def __init__(self, driver):
        self.driver = weakref.proxy(driver)   # (it holds this: no reference cycle)
        self.active = False       # the mode is popped: iterations run plain
        self.probing = False      # the probation iteration is being noted
        self.calls = []           # the probation iteration's (type(module), shapes)
        self.n = 0                # module calls seen in this steady iteration
        self.running = False      # a steady iteration has begun (a module was called)
        self.handle = None
        self.exits = 0
        self.streak = 0           # steady iterations since the steady state began
        self.thread = None        # the driver's thread (its mode is that thread's)
        self.late = 0             # steady iterations found diverged at their end
        self.marks = None         # (scheduled, diverged) iterations when one began
        self.counts = dict(steady_iterations=0, steady_exits=0)
        from vmalloc.frameworks.torch_pressure import Pressure
        self.pressure = Pressure(self)   # the steady state of a schedule that swaps

    # --- eligibility ----------------------------------------------------------------------
    def eligible(self) -> bool:
        d = self.driver
        return (self.exits < MAX_EXITS and d._kinds is None and not d._collective
                and not d._resized and "compile" not in d._said)

    def _marks(self):
        stats = self.driver.runtime.stats()
        return stats["scheduled_iterations"], stats["diverged_iterations"]

    def begin_probation(self):
        """At an iteration's start (before the runtime's): an armed probation whose schedule
        went away (a new optimizer, a promoted storage) is called off."""
        self.marks = self._marks()
        if self.probing and not quiet(self.driver):
            self.probing = False
            self._uninstall()
        if self.pressure.probing and not pressing(self.driver):
            self.pressure.disarm()

    def ended(self, failed: bool):
        """At the end of an iteration (after the runtime's; ``failed``: by an exception):
        a quiet probation that followed the schedule throughout, without divergence, begins
        the steady state; else the next iteration is armed as the probation if the schedule
        is quiet. The module calls are noted from this boundary on (the next iteration
        begins at its first op, after the first module call)."""
        d = self.driver
        scheduled, diverged = self._marks()
        followed = not failed and self.marks == (scheduled - 1, diverged)
        if self.probing and followed and self.calls and self.eligible() and quiet(d) \
                and self._mode_on_top():
            d._mode.__exit__(None, None, None)
            d._mode = None
            self.probing = False
            self.active = True
            self.streak = 0
            self.n = 0
            self.running = False
            return
        if self.pressure.probing:
            planned = self.pressure.plan()     # (disarms)
            if followed and planned and self.eligible() and pressing(d) \
                    and self._mode_on_top():
                d._mode.__exit__(None, None, None)
                d._mode = None
                self.active = True
                self.streak = 0
                self.running = False
                self.pressure.start()
                return
        self.probing = False
        self._uninstall()
        if not self.active and self.eligible():
            if quiet(d):
                self.calls = []
                self.probing = True
                self._install()
            elif pressing(d):
                self.pressure.arm()

    def _mode_on_top(self):
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        return _get_current_dispatch_mode() is self.driver._mode

    # --- the hook -------------------------------------------------------------------------
    def _install(self):
        self.thread = threading.get_ident()   # (the thread whose iteration ends here)
        if self.handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook
            self.handle = register_module_forward_pre_hook(self._pre_hook)

    def _uninstall(self):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _pre_hook(self, module, args):
        if threading.get_ident() != self.thread:
            return None       # another thread's modules: not the driver's iteration
        torch = sys.modules["torch"]
        Tensor = torch.Tensor
        key = (type(module), tuple([(a.shape, a.dtype) for a in args if isinstance(a, Tensor)]))
        if self.probing:
            self.calls.append(key)
            return None
        if not self.active:
            return None
        i = self.n
        self.n = i + 1
        self.running = True
        if i >= len(self.calls):
            self.leave(f"steady state: more module calls than the recorded {len(self.calls)}",
                       now=True)
        elif self.calls[i] != key:
            self.leave(f"steady state: module call {i} ({type(module).__name__}) differs "
                       "from the record (another module or other shapes)", now=True)
        return None

    # --- boundaries -----------------------------------------------------------------------
    def boundary(self, forced=False):
        """An iteration's end in the steady state (an optimizer stepped, or ``step()`` ended).
        ``forced``: end it even if no module was called (a manual ``step()``)."""
        if not (self.running or forced):
            return     # (a second optimizer's step in the same iteration)
        self.driver._storages.collect()
        self.counts["steady_iterations"] += 1
        self.streak += 1
        diverged = self.pressure.boundary() if self.pressure.active else None
        if not self.eligible():
            self.late += 1
            self.leave("steady state: a storage was resized outside the dispatcher")
        elif diverged is not None:
            self.late += 1
            self.leave(diverged)
        elif not self.pressure.active and self.n != len(self.calls):
            self.late += 1
            self.leave(f"steady state: the iteration made {self.n} module calls; the record "
                       f"made {len(self.calls)}")
        self.n = 0
        self.running = False

    def leave(self, reason, now=False):
        """Divergence: back to the dispatch path. ``now``: in the middle of an iteration (the
        rest of it runs on demand under the budget); else from the next iteration, which is
        recorded anew."""
        from vmalloc.frameworks.torch_state import make_mode
        if not self.active:
            return
        d = self.driver
        self.active = False
        self.pressure.stop()           # every storage it swapped out back first
        if self.streak >= STREAK:
            self.exits = 0
        self.exits += 1
        self.counts["steady_exits"] += 1
        d._mode = make_mode(d)
        d._mode.__enter__()
        rt = d.runtime
        if now and not rt.in_iteration:
            d._begin_iteration()       # (follows the quiet record: nothing moves)
        rt.invalidate(reason)          # the rest on demand; the next iteration records
        self.probing = False           # (that iteration is no probation)
        self._uninstall()

    def close(self):
        """The block ends (the mode is already popped when active)."""
        self._uninstall()
        self.pressure.stop()
        self.pressure.disarm()
        was = self.active
        self.active = self.probing = False
        return was


class ManualStep:
    """``OutOfCore.step()``: one iteration marked explicitly (for loops without an optimizer
    ``step()``); in the steady state its end is the iteration's boundary."""

    def __init__(self, driver):
        self.driver = driver

    def __enter__(self):
        driver = self.driver
        driver._manual = True
        if not driver._steady.active:
            driver._begin_iteration()
        return driver

    def __exit__(self, exc_type, exc, tb):
        driver = self.driver
        try:
            if driver._steady.active:
                driver._steady.boundary(forced=True)
            elif driver.runtime.in_iteration:
                driver._end_iteration(failed=exc_type is not None)
        finally:
            driver._manual = False
        return False
