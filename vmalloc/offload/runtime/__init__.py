"""The runtime: out-of-core training of a live program, driven by a schedule.

A framework driver (or a program by hand) tells the runtime three things: which memory it may
swap (:meth:`Runtime.allocate`, :meth:`Runtime.adopt`), where each iteration starts and ends
(:meth:`Runtime.iteration`, or ``begin_iteration`` / ``end_iteration``) and which allocations
each function reads and writes (:meth:`Runtime.function`, or ``enter_function`` /
``exit_function``). The first iteration is *recorded* while it runs on demand; then the
runtime builds a :class:`~vmalloc.offload.FunctionSequence` from the record, schedules it (the
window scheduler by default) and, on later iterations, issues the schedule's swap-outs,
swap-ins and waits at function boundaries through a :class:`~vmalloc.offload.SwapManager`
(or another swap backend with its methods).

A program may change (a data-dependent branch, a longer or shorter iteration, a last batch of
another size) or fail part-way (an out-of-memory, a refused swap-in). The runtime never trusts
the record blindly: before every function it checks that each listed allocation is resident
and swaps in on demand what is not, evicting the least recently used allocations when the
budget or the device is full. When an iteration departs from the record, the rest of it runs
on demand, it is recorded anew, and the next iteration runs a new schedule
(``stats()["reschedules"]``).

The driver protocol (the methods every framework driver uses) is described in
docs/runtime.rst. The class is assembled from one module per concern: ``buffers`` (buffers,
residency and eviction), ``recording``, ``following`` (a schedule), ``divergence``,
``recompute`` (drop and re-run), ``compression`` (compressed swaps), ``scopes`` (the context
managers), and ``core`` (the public class).
"""

from vmalloc.offload.runtime.buffers import Buffer, FunctionPointers
from vmalloc.offload.runtime.core import DEFAULT_MARGIN_FRACTION, STATS_KEYS, Runtime
from vmalloc.offload.runtime.recording import BudgetWarning, warn_user

__all__ = ["Runtime", "Buffer", "FunctionPointers", "BudgetWarning", "STATS_KEYS",
           "DEFAULT_MARGIN_FRACTION", "warn_user"]
