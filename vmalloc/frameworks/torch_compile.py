"""Compiled PyTorch training out of core: vmalloc's plan as a selective-checkpoint policy.

``torch.compile`` can save, recompute or offload each activation of a checkpointed region
(``torch.utils.checkpoint.CheckpointPolicy``: ``MUST_SAVE``, ``MUST_RECOMPUTE``,
``MUST_CPU_OFFLOAD``) and AOTAutograd lowers offloads into the graphs; it does not decide which.
:func:`policy` decides with vmalloc's planner, under a byte budget and a link speed:

1. **Record.** One training iteration (forward, loss, backward, optimizer step) is recorded by
   :func:`vmalloc.offload.record` (the out-of-core runtime's rules for what an op reads and
   writes) on a copy of the model made of FakeTensors on the meta device, so recording needs
   no memory at all, and a model that branches on whether it is traced takes the branch
   ``torch.compile`` takes (Hugging Face's mask code): see
   :mod:`vmalloc.frameworks.torch_compile_record`, which also says why not a real-device copy.
2. **Plan.** :func:`vmalloc.offload.plan` searches the window scheduler with recompute as a
   choice (:mod:`vmalloc.offload.scheduling.recompute`) at the given budget, simulating a GPU
   whose link runs at ``link_gbps``.
3. **Map.** Each activation the forward produces gets the plan's decision: swapped out in the
   forward and swapped back in the backward ("across the turn") -> ``MUST_CPU_OFFLOAD``;
   recomputed -> ``MUST_RECOMPUTE``; otherwise ``MUST_SAVE``. An op with several outputs takes
   recompute only if its first output is recomputed, else offload if any output is offloaded.

**Matching.** The policy function sees the region's aten ops in order; the decision's key is
``(op name, occurrence of that name in the region)``, e.g. ``("aten.addmm.default", 2)``.
The keys are made by replaying the model's forward on meta under the recorder's own dispatch
mode with a counting mode inside it, so each recorded function knows its key; that forward must
be the recorded iteration's prefix, function for function (else nothing is mapped: said once,
everything ``MUST_SAVE``). At run time an op that moves data but has no key is said once (a
``UserWarning``; ``stats()["unmatched_ops"]``) and saved: ``MUST_SAVE`` is always correct,
only that activation's plan is not followed. It happens when the region is not what was
recorded (another model, shapes that change the op sequence) and where the device picks other
kernels than meta: recorded on meta, attention is the math path (``bmm``, ``_safe_softmax``),
on CPU one ``_scaled_dot_product_flash_attention_for_cpu``; other ops keep their keys (the
count is per name). Views and metadata ops are ``PREFER_RECOMPUTE`` (free to recompute;
saving a view would pin its base beyond the plan). Recompute is mapped only onto ops that give
the same bits again (:func:`~vmalloc.frameworks.torch_recompute.rerunnable`), offload only
onto single-output ops (AOTAutograd offloads one tensor per node); else saved and counted.

**Offloading in AOTAutograd.** In the installed PyTorch nothing turns ``MUST_CPU_OFFLOAD`` into
the partitioner's ``should_offload`` mark; :func:`offloading_config` adds a joint-graph pass
(``torch._functorch.config.joint_custom_pass``) that marks those nodes and hands them to the
partitioner as ``MUST_SAVE`` (saved, then moved: left as CPU_OFFLOAD, its min-cut failed on a
transformer block), and turns on ``enable_activation_offloading`` with
``activation_offload_cpu_gpu_bw = link_gbps``. With CUDA it also asks for the separate copy
stream, sunk waits and reload prefetch; on CPU the synchronous form is used (those passes
manage CUDA streams): the forward graph holds ``prims.device_put(x, cpu)`` nodes named
``cpu_offload_*``, the backward ``gpu_reload_*``, where a GPU would copy, but a CPU-to-CPU
copy saves no memory. :func:`compile_out_of_core` applies all of it. Not applied: the plan's
swaps of parameters and optimizer state (``stats()["persistent_swaps_ignored"]``).
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.sequence import aten_ops

__all__ = ["CompilePolicy", "compile_out_of_core", "measured_link_gbps", "offloading_config",
           "policy", "CPU_LINK_GBPS"]

#: The link speed (GB/s, each direction) assumed without CUDA or a measurement: a PCIe 3.0 x16
#: link's pinned copy rate, as the simulator's ``v100-16gb`` model has it.
CPU_LINK_GBPS = 12.0

SAVE, RECOMPUTE, OFFLOAD = "save", "recompute", "offload"
_SERIALS = itertools.count()


def _torch():
    try:
        import torch
    except ImportError as error:  # pragma: no cover - torch is optional
        raise ImportError(f"vmalloc.torch.policy needs PyTorch (pip install torch): "
                          f"{error}") from error
    return torch


def measured_link_gbps(nbytes=64 << 20, repeats=3):
    """The host link's pinned copy speed (GB/s, the slower direction, best of ``repeats``) of
    the current CUDA device, measured as ``vmalloc doctor`` measures it (pinned host memory,
    one direction at a time) but through PyTorch: the probe is a layer above the frameworks.
    :data:`CPU_LINK_GBPS` without CUDA."""
    torch = _torch()
    if not torch.cuda.is_available():
        return CPU_LINK_GBPS
    import time
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = []
    for dst, src in ((device, host), (host, device)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        best.append(nbytes / min(times) / 1e9)
    return min(best)


class CompilePolicy:
    """vmalloc's plan as a selective-checkpoint ``context_fn``: pass ``plan.context_fn`` as
    ``checkpoint(..., use_reentrant=False, context_fn=plan.context_fn)`` (a plain function,
    which ``torch.compile`` requires). Each call makes fresh occurrence counters. Eager
    (uncompiled) checkpointing saves only ``*_SAVE`` ops: there the offloads are recomputed.
    Attributes: ``decisions`` ({(op name, occurrence): "save" |
    "recompute" | "offload"}), ``plan`` (the :class:`vmalloc.offload.Plan`), ``sequence`` (the
    recorded :class:`~vmalloc.offload.FunctionSequence`), ``budget``, ``link_gbps``,
    ``serial`` (unique in the process: the compiled region's guard, one graph per plan)."""

    def __init__(self, decisions, plan, sequence, budget, link_gbps, counts):
        self.decisions = decisions
        self.plan = plan
        self.serial = next(_SERIALS)
        self.sequence = sequence
        self.budget = budget
        self.link_gbps = link_gbps
        self._counts = dict(counts)
        # Keys, not calls: dynamo and AOTAutograd each trace the region (and eager runs it
        # again to recompute), so one op meets the policy more than once.
        self._refused = {"unmatched": set(), "recompute": set(), "offload": set(),
                         "eager": set()}
        self._said = set()
        #: False when the plan could not be mapped (already said): nothing is unmatched then.
        self.mapped = bool(decisions)

        def context_fn():
            from torch.utils.checkpoint import create_selective_checkpoint_contexts
            return create_selective_checkpoint_contexts(self.policy_fn())
        # A plain function: what torch.compile accepts as context_fn (not a callable object).
        self.context_fn = context_fn

    def __call__(self):
        return self.context_fn()

    def policy_fn(self):
        """A fresh policy function ``(ctx, func, *args, **kwargs) -> CheckpointPolicy`` for
        one run of the region (forward and recompute counted apart)."""
        from torch.utils.checkpoint import CheckpointPolicy as P
        from vmalloc.frameworks.torch_recompute import rerunnable
        counts = {False: Counter(), True: Counter()}

        def decide(ctx, func, *args, **kwargs):
            name = str(func)
            seen = counts[bool(ctx.is_recompute)]
            index = seen[name]
            seen[name] += 1
            if not aten_ops.is_function(func):
                return P.PREFER_RECOMPUTE
            what = self.decisions.get((name, index))
            if what == OFFLOAD and self.mapped and _eager(args):
                self._eager((name, index))
            if what is None:
                if self.mapped:
                    self._unmatched(name, index)
                return P.MUST_SAVE
            if what == OFFLOAD:
                if len(func._schema.returns) == 1:
                    return P.MUST_CPU_OFFLOAD
                # AOTAutograd offloads one tensor per node: a multi-output op's node is a
                # tuple (its partitioner fails on it), so such an op is saved.
                self._refused["offload"].add((name, index))
                return P.MUST_SAVE
            if what == RECOMPUTE:
                if rerunnable(func, "cpu"):
                    return P.MUST_RECOMPUTE
                self._refused["recompute"].add((name, index))
            return P.MUST_SAVE
        return decide

    def _unmatched(self, name, index):
        self._refused["unmatched"].add((name, index))
        self._say("unmatched", f"{name} (occurrence {index}) in the checkpointed region is "
                  "not in the recorded forward: saved (MUST_SAVE); the region differs from the "
                  "model and example the policy was made for, so the plan is not followed")

    def _eager(self, key):
        self._refused["eager"].add(key)
        self._say("eager", "the checkpointed region runs eagerly (torch.compile broke its graph "
                  "inside it, TORCH_LOGS=graph_breaks says where, or it is not compiled): eager "
                  "selective checkpointing recomputes what the plan offloads")

    def _say(self, what, message):
        if what not in self._said:
            self._said.add(what)
            from vmalloc.offload.runtime.recording import warn_user
            warn_user(message, UserWarning)

    def stats(self) -> dict:
        """Counts: ``offload``, ``recompute``, ``save`` (decisions made), ``unmatched_ops``
        (ops met that had none), ``recompute_refused`` (planned recomputes of ops that
        would not give the same bits: saved), ``offload_refused`` (planned offloads of ops
        with several outputs, which AOTAutograd cannot offload: saved),
        ``offloads_run_eagerly`` (planned offloads met in a region that runs eagerly, where
        selective checkpointing recomputes them: a graph break inside the region, said once),
        ``persistent_swaps_ignored`` (the plan's swaps of parameters and optimizer state)."""
        out = dict(self._counts)
        out.update(unmatched_ops=len(self._refused["unmatched"]),
                   recompute_refused=len(self._refused["recompute"]),
                   offload_refused=len(self._refused["offload"]),
                   offloads_run_eagerly=len(self._refused["eager"]))
        return out

    def __repr__(self):
        c = self.stats()
        return (f"CompilePolicy(budget={self.budget}, link_gbps={self.link_gbps:g}, "
                f"offload={c[OFFLOAD]}, recompute={c[RECOMPUTE]}, save={c[SAVE]})")


def _eager(args):
    """Whether the policy is asked with real tensors: the region runs eagerly (compiling, it
    is asked while AOTAutograd traces FakeTensors)."""
    from torch._subclasses.fake_tensor import is_fake
    torch = _torch()
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return t is not None and not is_fake(t)


def _decide(seq, sched, keys):
    """{key: decision} for the forward's functions (the first len(keys) of seq)."""
    rc = sched.recompute
    turn = len(keys)                # the first backward function, in the steps' numbering
    if rc is not None:
        turn = rc.index[turn] if turn < len(rc.index) else len(sched.steps)
    out_fw = {v for s in sched.steps[:turn] for v in s.swap_out}
    in_bw = {v for s in sched.steps[turn:] for v in s.swap_in}
    recomputed = set(rc.variables) if rc is not None else set()
    decisions, born = {}, set()
    for key, f in zip(keys, seq.functions):
        what = SAVE
        fresh = [v for v in f.outputs if v not in born and v not in f.inputs
                 and not seq.variables[v].persistent]
        born.update(f.outputs)
        if fresh and fresh[0] in recomputed:
            what = RECOMPUTE
        elif any(v in out_fw and v in in_bw for v in fresh):
            what = OFFLOAD
        decisions[key] = what
    return decisions


def policy(model, example, loss_fn=None, budget=None, link_gbps=None, optimizer="sgd",
           gpu="v100-16gb", strict=False) -> CompilePolicy:
    """vmalloc's plan for compiled training of ``model`` as a :class:`CompilePolicy`.

    Args:
        model: the ``torch.nn.Module`` whose forward will be the checkpointed region.
        example: a batch as :func:`vmalloc.offload.record` takes it: a tensor, or ``(args,
            target)``; or ``(kwargs, target)`` with a dict of keyword arguments (``model(
            **kwargs)``, e.g. ``input_ids`` and ``attention_mask``); ``loss_fn(output, target)``
            (None: ``output.sum()``, or ``output[0].sum()`` for a tuple).
        budget: device bytes (int or ``"12GiB"``) the iteration may hold at once: parameters,
            gradients, optimizer state and activations, as the planner counts them.
        link_gbps: host link speed in GB/s; None: measured on CUDA
            (:func:`measured_link_gbps`), :data:`CPU_LINK_GBPS` without.
        optimizer: as for :func:`vmalloc.offload.record` (``"sgd"``, a factory or None).
        gpu: the simulator's GPU model (compute speed, memory); its link is set to
            ``link_gbps``.
        strict: raise :class:`vmalloc.offload.ScheduleError` when no plan fits the budget,
            instead of warning once and saving everything.

    Raises:
        InvalidArgumentError: bad arguments, or a forward that reads a tensor's value (a
            data-dependent branch that does not ask for FakeTensors, ``nonzero``): it cannot
            be recorded, and ``torch.compile`` would break its graph there (train it eagerly
            with :func:`vmalloc.torch.out_of_core`).
    """
    torch = _torch()
    from vmalloc.frameworks.torch_compile_record import record_iteration, split_example
    from vmalloc.offload import plan as make_plan
    from vmalloc.offload.hardware.gpus import get_gpu
    from vmalloc.offload.scheduling.schedule import ScheduleError
    from vmalloc.sizes import parse_size
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if budget is None:
        raise InvalidArgumentError("budget is required: the device bytes the plan may use")
    budget = parse_size(budget, "budget")
    link = measured_link_gbps() if link_gbps is None else float(link_gbps)
    if not link > 0:
        raise InvalidArgumentError(f"link_gbps must be positive, got {link_gbps!r}")
    bw = link * 1e9
    machine = get_gpu(gpu).with_(h2d_bandwidth=bw, d2h_bandwidth=bw, bidirectional_bandwidth=bw)
    if machine.memory_bytes < budget:
        machine = machine.with_(memory_bytes=budget)
    args = split_example(model, example)[2]
    # The batch makes the simulation report speed (images/s), which the planner maximizes.
    batch = next((int(a.shape[0]) for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)
    seq, keys = record_iteration(model, example, loss_fn, optimizer, batch)
    counts = {SAVE: 0, RECOMPUTE: 0, OFFLOAD: 0, "persistent_swaps_ignored": 0}
    names = [f.name for f in seq.functions[:len(keys)]]
    chosen = make_plan(seq, gpu=machine, budget=budget, recompute=True)
    result = CompilePolicy({}, chosen, seq, budget, link, counts)
    if names != [k[0] for k in keys]:
        result._say("mismatch", "the model's forward is not the recorded iteration's prefix, "
                    "op for op: nothing is mapped, every activation is saved (MUST_SAVE)")
        return result
    if not chosen.feasible:
        message = (f"no plan fits the budget of {budget} bytes ({chosen.reason}): every "
                   "activation is saved (MUST_SAVE)")
        if strict:
            raise ScheduleError(message)
        result._say("unschedulable", message)
        return result
    result.decisions = _decide(seq, chosen.schedule, keys)
    result.mapped = True
    for what in result.decisions.values():
        result._counts[what] += 1
    result._counts["persistent_swaps_ignored"] = sum(
        1 for v in chosen.schedule.swapped_out()
        if v < len(seq.variables) and seq.variables[v].persistent)
    return result


def _mark_offloads(previous, graph, inputs):
    """Joint-graph pass: the partitioner offloads nodes marked ``should_offload``; mark those
    the policy said ``*_CPU_OFFLOAD``, then run the pass that was configured before."""
    from torch.utils.checkpoint import CheckpointPolicy as P
    for node in graph.graph.nodes:
        if node.meta.get("recompute") in (P.MUST_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD):
            node.meta["should_offload"] = True
            # Offloaded means saved, then moved: the partitioner knows only save/recompute
            # (left as CPU_OFFLOAD, its min-cut may cut elsewhere and fail on a getitem).
            node.meta["recompute"] = P.MUST_SAVE
    return previous(graph, inputs) if callable(previous) else graph


def offloading_config(link_gbps=None) -> dict:
    """The ``torch._functorch.config`` settings under which compiling lowers ``*_CPU_OFFLOAD``
    into offload / reload ops (use with ``torch._functorch.config.patch(**...)`` around the
    calls that compile). With CUDA: a separate copy stream, sunk waits, reload prefetch."""
    torch = _torch()
    import torch._functorch.config as fc
    link = measured_link_gbps() if link_gbps is None else float(link_gbps)
    cfg = dict(enable_activation_offloading=True, activation_offload_cpu_gpu_bw=link,
               joint_custom_pass=functools.partial(_mark_offloads, fc.joint_custom_pass))
    if torch.cuda.is_available():
        cfg.update(activation_offload_separate_stream=True, activation_offload_sink_wait=True,
                   activation_reload_prefetch=True)
    return cfg


def compile_out_of_core(model, plan: CompilePolicy, backend="inductor", **options):
    """``model`` compiled with ``plan`` applied: its forward is one checkpointed region
    (``use_reentrant=False, context_fn=plan.context_fn``), compiled by ``torch.compile(backend=...,
    **options)``, and called under :func:`offloading_config` (``plan.link_gbps``). Returns a
    module sharing ``model``'s parameters."""
    torch = _torch()
    if not isinstance(plan, CompilePolicy):
        raise InvalidArgumentError(f"plan must be a CompilePolicy (vmalloc.torch.policy(...)), "
                                   f"got {type(plan).__name__}")
    return _Compiled(model, plan, torch.compile(_Region(model, plan), backend=backend,
                                                **options))


@functools.lru_cache(maxsize=None)
def _region_class():
    """The two module classes, made on first use: importing this file never imports torch."""
    torch = _torch()

    class Region(torch.nn.Module):
        def __init__(self, model, plan):
            super().__init__()
            self.model, self.plan = model, plan

        def forward(self, *args, **kwargs):
            from torch.utils.checkpoint import checkpoint
            # A branch on the plan's serial: dynamo guards it, so another plan recompiles
            # (its cache is keyed on this code, and it guards nothing of context_fn).
            if self.plan.serial < 0:
                raise AssertionError("a plan's serial is never negative")
            return checkpoint(self.model, *args, use_reentrant=False,
                              context_fn=self.plan.context_fn, **kwargs)

    class Compiled(torch.nn.Module):
        def __init__(self, model, plan, compiled):
            super().__init__()
            self.model, self.plan, self.compiled = model, plan, compiled
            self._config = offloading_config(plan.link_gbps)

        def forward(self, *args, **kwargs):
            import torch._functorch.config as fc
            with fc.patch(**self._config):
                return self.compiled(*args, **kwargs)
    return Region, Compiled


def _Region(model, plan):
    return _region_class()[0](model, plan)


def _Compiled(model, plan, compiled):
    return _region_class()[1](model, plan, compiled)
