"""Recompute and compression: moving fewer bytes than swapping.

**Recompute** (Capuchin-style, chosen per variable). A transient variable ``v`` written by a
*chain* of functions -- its producer (writes ``v`` without reading it) then any in-place writers
(read and write ``v``: ``relu_``, ``add_``) -- and read again after a long gap can be dropped
after its last use before the gap and **recomputed** just before its first use after it, by
re-running the chain, instead of being swapped out and back in. The schedule expresses it by
*expanding* the sequence: :func:`with_recompute` inserts one function per chain member before
that use, writing a clone ``v'`` (same size) that every later read uses; the original ``v``'s
last use is then before the gap, so the scheduler frees it. Each inserted function reads the
chain member's other inputs, so any scheduler brings them in (the rule "a recomputed variable's
inputs are resident when it is recomputed" is the ordinary read rule). The producer's other
outputs (BatchNorm's saved mean and invstd) are written to scratch variables freed at once:
their bytes count.

A chain qualifies when every external input is persistent or read again at or after the
recompute point (it will be on the device then anyway), none was written since the chain ran
(so the recompute reproduces the same bits), and re-running it is cheaper than moving ``v``:
``sum of the chain's model times < ratio * 2 * nbytes / link bandwidth``. Memory-bound
functions (BatchNorm, ReLU, adds: FLOPs per byte under the GPU's ridge point) qualify first;
compute-bound ones (convolutions, matmuls) only with ``compute_bound=True``, which the planner
tries and keeps only when the simulation shows it pays.

**Compression** (opt-in, never the default; IBM LMS's HalfComp): float32 activations swapped as
fp16/bf16 move half their bytes over the link and pay a cast on the copy stream (read 4 bytes,
write 2: ``1.5 * nbytes / HBM bandwidth``). The sequences carry no dtype: a transient variable
whose size scales with the batch is taken as a float32 activation, except the integer indices
of ``max_pool2d_with_indices`` (its second output).
"""

from __future__ import annotations

from bisect import bisect_right
from operator import itemgetter
from typing import Dict, List

from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.scheduling.schedule import ScheduleError, paused_gc
from vmalloc.offload.sequence.sequence import Function, FunctionSequence, Variable

__all__ = ["check_recompute", "Recompute", "recompute_candidates", "with_recompute", "compressible",
           "COMPRESSIONS", "MIN_GAP"]

#: The compressed formats: bytes on the link per float32 byte.
COMPRESSIONS = {"fp16": 0.5, "bf16": 0.5}
#: The least gap (functions) between two uses for a variable to be worth recomputing.
MIN_GAP = 16


class Recompute:
    """What :func:`with_recompute` did: ``sequence`` (the expanded sequence), ``origin``
    (expanded function index -> the original function it re-runs, for inserted functions),
    ``clones`` (clone variable id -> original id), ``variables`` (the original ids recomputed)
    and ``index`` (original function index -> expanded index)."""

    def __init__(self, sequence, origin, clones, variables, index):
        self.sequence = sequence
        self.origin: Dict[int, int] = origin
        self.clones: Dict[int, int] = clones
        self.variables: List[int] = variables
        self.index: List[int] = index

    def __repr__(self):
        return (f"Recompute({len(self.variables)} variables, {len(self.origin)} functions "
                f"re-run)")


def _chains(seq):
    """v -> (chain of function indices, the use index after which the gap starts, the first
    read use after the gap) for each transient variable with a chain and a long gap."""
    uses = seq.uses()
    fns = seq.functions
    variables = seq.variables
    out = {}
    # transient, used twice or more, over a span where a gap of MIN_GAP functions can fit
    for v in [v for v, u in enumerate(uses) if len(u) > 1 and u[-1] - u[0] >= MIN_GAP]:
        if variables[v].persistent:
            continue
        u = uses[v]
        f0 = fns[u[0]]
        if v not in f0.outputs or v in f0.inputs or not f0.inputs:
            continue                    # not produced here (outside data or read-modify), or
            #                             produced from nothing (a data load, a random fill)
        chain = [u[0]]
        k = 1
        nu = len(u)
        while k < nu and u[k] - u[k - 1] < MIN_GAP:
            g = fns[u[k]]
            if v not in g.outputs or v not in g.inputs:
                break
            chain.append(u[k])
            k += 1
        # the first long gap after the chain, ending in a read; no write of v after the chain
        gap = None
        a = u[k - 1]
        for j in range(k, nu):
            b = u[j]
            g = fns[b]
            if v in g.outputs:
                gap = None
                break
            if gap is None and b - a >= MIN_GAP and v in g.inputs:
                gap = (a, b)
            a = b
        if gap is not None:
            out[v] = (chain, gap[0], gap[1])
    return out


def recompute_candidates(seq, gpu, ratio=1.0, compute_bound=False, eligible=None) -> List[int]:
    """The transient variables worth recomputing on ``gpu`` (see the module docstring), largest
    saving first. ``eligible(v, chain)``: whether the caller can recompute variable ``v`` by
    re-running ``chain`` (function indices) at all (a runtime: every function has a rerun)."""
    from vmalloc.offload.hardware.gpus import get_gpu

    gpu = get_gpu(gpu)
    with paused_gc():
        return _candidates(seq, gpu, ratio, compute_bound, eligible)


def _candidates(seq, gpu, ratio, compute_bound, eligible):
    fns = seq.functions
    var = seq.variables
    uses = seq.uses()
    sizes = [x.nbytes for x in var]
    persistent = [x.persistent for x in var]
    # the simulator's model time (GPU.compute_seconds), inlined: the same arithmetic
    flop_rate = gpu.peak_flops * gpu.compute_efficiency
    hbm = gpu.hbm_bandwidth
    overhead = gpu.function_overhead_seconds
    ridge = gpu.peak_flops * gpu.compute_efficiency / gpu.hbm_bandwidth   # FLOP per byte
    link = min(gpu.h2d_bandwidth, gpu.d2h_bandwidth)

    chosen = []
    chains = _chains(seq)
    # reused by with_recompute while the sequence is unchanged (sequences only grow)
    seq._recompute_chains = (len(seq.functions), len(seq.variables), chains)
    for v, (chain, a, b) in chains.items():
        nbytes = sizes[v]
        if nbytes <= 0 or (eligible is not None and not eligible(v, chain)):
            continue
        ok = True
        cost = 0.0
        for c in chain:
            f = fns[c]
            touched = sum([sizes[x] for x in {*f.inputs, *f.outputs}])
            flops = f.flops
            if not compute_bound and (flops or 0.0) / (touched or 1) > ridge:
                ok = False
                break
            if f.seconds is not None:
                cost += f.seconds
            else:
                t = flops / flop_rate if flops else 0.0
                if touched:
                    t = max(t, touched / hbm)
                cost += t + overhead
            for x in f.inputs:
                if x == v:
                    continue
                # a weight or buffer unchanged between the chain and the recompute; a
                # transient input also read again at or after b (so resident around b anyway)
                ux = uses[x]
                if not persistent[x] and ux[-1] < b:
                    ok = False
                    break
                # no write of x strictly between c and b (x's uses are sorted)
                k = bisect_right(ux, c)
                nx = len(ux)
                while k < nx and ux[k] < b:
                    if x in fns[ux[k]].outputs:
                        ok = False
                        break
                    k += 1
                if not ok:
                    break
            if not ok:
                break
        if ok and cost < ratio * 2 * nbytes / link:
            ins = {x for c in chain for x in fns[c].inputs if x != v and not persistent[x]}
            chosen.append((-(2 * nbytes / link - cost), v, ins))
    # largest saving first, then by id: chosen is in id order (chains' order) and the sort
    # stable
    chosen.sort(key=itemgetter(0))
    # a chain must read originals that stay on the device: no accepted variable is the input
    # of another accepted chain (else recomputing one would keep the other's original alive)
    accepted, inputs = [], set()
    taken = set()
    for _, v, ins in chosen:
        if v in inputs or not ins.isdisjoint(taken):
            continue
        accepted.append(v)
        taken.add(v)
        inputs |= ins
    return accepted


def with_recompute(seq, variables) -> Recompute:
    """``seq`` expanded so that each variable of ``variables`` (see :func:`recompute_candidates`)
    is recomputed before its first read after its long gap instead of being kept or swapped."""
    with paused_gc():
        return _with_recompute(seq, variables)


def _with_recompute(seq, recomputed):
    cached = getattr(seq, "_recompute_chains", None)
    if cached is not None and cached[:2] == (len(seq.functions), len(seq.variables)):
        chains = cached[2]
    else:
        chains = _chains(seq)
    recomputed = sorted(set(recomputed))
    todo = {}
    for v in recomputed:
        if v not in chains:
            raise InvalidArgumentError(f"variable {v} cannot be recomputed (no chain and gap)")
        chain, a, b = chains[v]
        todo.setdefault(b, []).append((v, chain))
    out = FunctionSequence(seq.name, seq.batch, seq.meta)
    variables = out.variables = list(seq.variables)
    functions = out.functions
    # built directly (the sequence's add_* would re-validate ids the original already holds)

    def add_var(like, name):
        vid = len(variables)
        variables.append(Variable(vid, like.nbytes, False, name, like.per_sample_bytes))
        return vid

    fns = seq.functions
    rename: Dict[int, int] = {}           # original v -> clone, active from its recompute on
    origin: Dict[int, int] = {}
    clones: Dict[int, int] = {}
    index: List[int] = []
    append = functions.append
    new = tuple.__new__          # Function(...) without its Python-level __new__
    for i, f in enumerate(fns):
        here = todo.get(i)
        if here:
            for v, chain in sorted(here, key=lambda t: t[1][0]):
                # chains in production order: one may read a variable another re-creates here
                w = add_var(seq.variables[v], seq.variables[v].name + "'")
                clones[w] = v
                for c in chain:
                    g = fns[c]
                    outs = [w if x == v else add_var(seq.variables[x], seq.variables[x].name + "~")
                            for x in g.outputs]   # the producer's other outputs: scratch
                    ins = [w if x == v else rename.get(x, x) for x in g.inputs]
                    k = len(functions)
                    append(new(Function, (k, "recompute:" + g.name, tuple(ins), tuple(outs),
                                          g.flops, g.seconds, g.per_sample_flops)))
                    origin[k] = c
                rename[v] = w
        k = len(functions)
        index.append(k)
        ins, outs = f.inputs, f.outputs
        if rename:
            # renamed reads and writes only where a clone replaces a variable
            if not rename.keys().isdisjoint(ins):
                ins = tuple([rename.get(x, x) for x in ins])
            if outs and not rename.keys().isdisjoint(outs):
                outs = tuple([rename.get(x, x) for x in outs])
        if ins is f.inputs and outs is f.outputs:
            # unchanged but for its index: (index,) + the other fields
            append(f if k == i else new(Function, (k,) + f[1:]))
        else:
            append(new(Function, (k, f.name, ins, outs) + f[4:]))
    out._uses = None
    return Recompute(out, origin, clones, recomputed, index)


def compressible(seq) -> List[int]:
    """Variables taken as float32 activations (see the module docstring)."""
    ids = []
    produced_as_indices = set()
    for f in seq.functions:
        if "with_indices" in f.name and len(f.outputs) > 1:
            produced_as_indices.update(f.outputs[1:])
    for v in seq.variables:
        if (not v.persistent and v.per_sample_bytes > 0 and v.id not in produced_as_indices):
            ids.append(v.id)
    return ids


def check_recompute(sched, seq):
    """The recompute rules on top of the ordinary ones (which then run on the expanded
    sequence): the expanded sequence is ``seq`` with functions inserted; each inserted function
    re-runs its original with the same inputs (a clone standing for the variable it re-creates),
    and none of those inputs was written between the original and the re-run, so the recompute
    reproduces the same bits. Returns the expanded sequence."""
    rc = sched.recompute
    ex = rc.sequence
    fns = seq.functions
    if len(rc.index) != len(fns):
        raise ScheduleError(f"the recompute plan maps {len(rc.index)} functions; the sequence "
                            f"has {len(fns)}")
    for i, k in enumerate(rc.index):
        g = ex.functions[k]
        if g.name != fns[i].name:
            raise ScheduleError(f"function {i} ({fns[i].name}) is {g.name} in the expanded "
                                "sequence", function=i)
    last_write = {}
    at = {}                  # expanded index -> position of each write, per variable
    for k, g in enumerate(ex.functions):
        for x in g.outputs:
            last_write.setdefault(x, []).append(k)
        at[k] = g
    clones = rc.clones
    for k, o in rc.origin.items():
        g = ex.functions[k]
        orig = fns[o]
        back = tuple(clones.get(x, x) for x in g.inputs)
        if back != orig.inputs:
            raise ScheduleError(f"recompute of function {o} ({orig.name}) reads other "
                                "variables than the original", function=None)
        ko = rc.index[o]
        for x in g.inputs:
            if x in clones:
                continue     # the variable being re-created (in place) or an earlier clone
            if any(ko < w < k for w in last_write.get(x, ())):
                raise ScheduleError(f"recompute of function {o} ({orig.name}): its input "
                                    f"{ex.variables[x].name} (v{x}) was written since the "
                                    "original ran: the recompute would differ", function=None)
    return ex
