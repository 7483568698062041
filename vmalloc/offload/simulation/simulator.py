"""Simulate one steady-state training iteration under a swap schedule.

:func:`simulate` is a discrete-event model of one iteration of a
:class:`~vmalloc.offload.FunctionSequence` run under a :class:`~vmalloc.offload.Schedule` on a
:class:`~vmalloc.offload.GPU`. Time is modelled; memory is not: every allocation, free,
swap-out release and swap-in acquisition goes through a real vmalloc allocator on an unbacked
:class:`vmalloc.HostDevice` of the GPU's capacity, so fragmentation and out-of-memory are the
allocator's own.

The model (``docs/simulating.rst`` has it in full):

- **Compute stream.** Functions run in order. Function ``i`` takes its measured ``seconds`` if
  the sequence has them, else ``max(flops / (peak * efficiency), bytes touched / HBM
  bandwidth) + overhead`` (:meth:`GPU.compute_seconds`). The GPU carries a framework profile
  and a precision (:mod:`vmalloc.offload.simulation.profiles`); under ``pytorch-eager`` the host also
  spends ``host_seconds`` launching each function, so a kernel starts no earlier than its launch.
- **Host.** The host issues each step's actions at its *issue time* ``h``: function ``i``'s
  actions are issued at the time function ``i - 1`` started (the host runs one function ahead of
  the device), or later if a ``wait_swap_out`` made the host wait for a copy.
- **Copy engines.** Two FIFO engines, host-to-device and device-to-host. A swap-in starts at
  ``max(issue time, engine free, the end of the variable's own last swap-out)``; a swap-out
  starts at ``max(end of its function, engine free)``. A copy moves at the one-direction
  bandwidth, or at the both-at-once figure while the other engine has a copy in flight (copies
  already placed are not slowed again by later ones: a one-sided approximation).
- **Waits.** ``wait_swap_in`` delays the function's start until those copies end;
  ``wait_swap_out`` moves the host's issue time to the copies' end (and releases their memory
  then). Function ``i`` starts at ``max(end of function i-1, issue time, swap-ins waited)``.
- **Iteration.** It ends when the compute stream, both engines and ``end_wait_swap_out`` are
  done (the runtime synchronises the device between iterations). The iteration runs twice on the
  same allocator (a warm cache, as in a training loop) and the second is reported; times are the
  same in both.

Memory operations happen at the host's issue time (stream-ordered allocation: memory freed on
the host may be reused by work issued later on the same stream).
"""

from __future__ import annotations

from collections import deque
import math
import weakref
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from vmalloc import allocator_kinds
from vmalloc.errors import InvalidArgumentError
from vmalloc.offload.hardware.gpus import get_gpu
from vmalloc.offload.simulation.sim_memory import _OOM, _Engine, _Memory
from vmalloc.sizes import parse_size

__all__ = ["simulate", "SimulationResult", "ALLOCATORS", "in_core_seconds", "function_seconds"]

#: The allocator kinds a simulation can run on: the package's one list (vmalloc.allocator_kinds).
ALLOCATORS = allocator_kinds.NAMES
DEFAULT_CHUNK = 2 << 20
GRANULARITY = 2 << 20


@dataclass
class SimulationResult:
    """What :func:`simulate` measured for one iteration. Times in seconds, sizes in bytes.
    ``iteration_seconds``, ``images_per_second`` and ``relative_speed`` are None after an
    out-of-memory."""

    model: str
    batch: Optional[int]
    gpu: str
    scheduler: str
    allocator: str
    chunk_size: Optional[int]
    params: dict
    iteration_seconds: Optional[float]
    images_per_second: Optional[float]
    in_core_seconds: float
    #: In-core images/s at this batch: only when this batch runs in core (else None).
    in_core_images_per_second: Optional[float]
    #: The paper's ratio: images/s over in-core images/s at the in-core limit (None when the
    #: limit is not known: pass ``reference`` to :func:`simulate`).
    relative_speed: Optional[float]
    compute_seconds: float
    stall_seconds: Dict[str, float]
    bound_seconds: float
    bound_ratio: Optional[float]
    serial_bound_seconds: float
    serial_bound_ratio: Optional[float]
    peak_requested_bytes: int
    peak_reserved_bytes: int
    budget_bytes: int
    capacity_bytes: int
    swapped_out_bytes: int
    swapped_in_bytes: int
    h2d_seconds: float
    d2h_seconds: float
    out_of_memory: bool
    #: The host link the copy times used (the GPU model's ``link`` and its bandwidths).
    link: str = ""
    #: The in-core limit (largest batch with no swaps) and its images/s: the paper's reference.
    in_core_limit_batch: Optional[int] = None
    in_core_limit_images_per_second: Optional[float] = None
    #: The other ratio: compute-only time at this batch / iteration time (memory unlimited).
    speed_vs_compute_only: Optional[float] = None
    #: images/s of this batch's compute alone (memory unlimited; not an in-core speed).
    compute_only_images_per_second: Optional[float] = None
    #: The framework profile and precision of the GPU model (vmalloc.offload.simulation.profiles).
    profile: str = ""
    precision: str = ""
    #: The same figure as ``speed_vs_compute_only``, named for what it compares: this batch's
    #: compute-only time over its iteration time. Printed beside ``relative_speed`` always.
    same_batch_compute_ratio: Optional[float] = None
    #: Host time in virtual-address mapping calls (create, map, set_access, unmap, ...), priced
    #: per call by the device's cost model, and how many such calls the iteration made.
    va_seconds: float = 0.0
    va_calls: int = 0
    #: Functions re-run by recompute and their model time (in ``compute_seconds``, not in
    #: ``in_core_seconds``); the compression format of compressed swaps (None: lossless).
    recomputed_functions: int = 0
    recompute_seconds: float = 0.0
    compression: Optional[str] = None
    oom_function: Optional[dict] = None
    oom_message: Optional[str] = None
    timeline: Optional[dict] = field(default=None, repr=False)

    def to_dict(self, timeline: bool = False) -> dict:
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        return d

    def summary(self) -> str:
        from vmalloc.sizes import format_size
        head = (f"{self.model or 'sequence'} batch {self.batch} on {self.gpu} (profile "
                f"{self.profile}, precision {self.precision}), {self.scheduler} + "
                f"{self.allocator}")
        if self.out_of_memory:
            f = self.oom_function or {}
            return (f"{head}: OUT OF MEMORY at function {f.get('index')} ({f.get('name')}); "
                    f"peak reserved {format_size(self.peak_reserved_bytes)} of "
                    f"{format_size(self.capacity_bytes)}")
        rel = (f"same_batch_compute_ratio {self.speed_vs_compute_only:.1%} of this batch's "
               f"compute-only speed")
        if self.relative_speed is not None:
            rel = (f"relative_speed {self.relative_speed:.1%} of in-core at the in-core limit "
                   f"(batch {self.in_core_limit_batch}, "
                   f"{self.in_core_limit_images_per_second:.1f} images/s), " + rel)
        if self.in_core_images_per_second is not None and self.in_core_limit_batch is not None:
            rel += f"; in core at this batch {self.in_core_images_per_second:.1f}"
        return (f"{head}, link {self.link}: {self.images_per_second:.1f} images/s "
                f"({rel}), iteration {self.iteration_seconds * 1e3:.1f} ms "
                f"(bound {self.bound_seconds * 1e3:.1f} ms, x{self.bound_ratio:.3f}); "
                f"peak requested {format_size(self.peak_requested_bytes)}, reserved "
                f"{format_size(self.peak_reserved_bytes)}, budget {format_size(self.budget_bytes)}; "
                f"swapped out {format_size(self.swapped_out_bytes)}, in "
                f"{format_size(self.swapped_in_bytes)}; VA mapping {self.va_calls} calls, "
                f"{self.va_seconds * 1e3:.1f} ms of host time")


def link_description(gpu) -> str:
    """The link model a simulation used, e.g. ``"NVLink 2 to POWER9 (2 bricks): H2D 45.9 /
    D2H 45.9 / both 45.9 GB/s"``."""
    return (f"{gpu.link or 'unnamed'}: H2D {gpu.h2d_bandwidth / 1e9:.1f} / D2H "
            f"{gpu.d2h_bandwidth / 1e9:.1f} / both {gpu.bidirectional_bandwidth / 1e9:.1f} GB/s")


def function_seconds(seq, gpu) -> List[float]:
    """The model's duration of each function of ``seq`` on ``gpu`` (a new list). Kept per
    (sequence, GPU) while the sequence's functions and variables are the same: a plan
    simulates one sequence dozens of times (``_function_seconds.computed`` counts the work)."""
    gpu = get_gpu(gpu)
    content = (tuple(seq.functions), tuple(seq.variables))
    cached = _SECONDS.get(seq)
    if cached is None or cached[0] != content:
        cached = _SECONDS[seq] = (content, {})
    if gpu not in cached[1]:
        cached[1][gpu] = tuple(_function_seconds(seq, gpu))
    return list(cached[1][gpu])


_SECONDS = weakref.WeakKeyDictionary()   # sequence -> ((functions, variables), {GPU: seconds})


def _function_seconds(seq, gpu):
    _function_seconds.computed += 1
    var = seq.variables
    return [f.seconds if f.seconds is not None
            else gpu.compute_seconds(f.flops, sum(var[v].nbytes for v in f.uses))
            for f in seq.functions]


_function_seconds.computed = 0


def in_core_seconds(seq, gpu) -> float:
    """Compute-only iteration time: every function back to back, no swaps, memory unlimited
    (under ``pytorch-eager``, no kernel before its launch on the host timeline)."""
    gpu = get_gpu(gpu)
    if gpu.host_seconds:
        from vmalloc.offload.simulation.profiles import host_chain_seconds

        return host_chain_seconds(function_seconds(seq, gpu), gpu.host_seconds)
    return math.fsum(function_seconds(seq, gpu))


def simulate(seq, schedule=None, gpu="v100-16gb", allocator="virtual", chunk_size=None,
             capacity=None, timeline=False, iterations=2,
             steal_before_create=True, release_completed=None,
             reference=None, va_costs=True) -> SimulationResult:
    """Simulates one steady-state iteration of ``seq`` under ``schedule`` on ``gpu``.

    Args:
        seq: a :class:`~vmalloc.offload.FunctionSequence`.
        schedule: a :class:`~vmalloc.offload.Schedule` (None: in-core, everything allocated at
            first use and freed after last use, persistent variables resident).
        gpu: a :class:`~vmalloc.offload.GPU` or a name in :data:`~vmalloc.offload.GPUS`.
        allocator: ``"virtual"`` (chunk placement), ``"virtual-packed"`` or ``"caching"``
            (best-fit, PyTorch's policy).
        chunk_size: the virtual allocator's physical chunk (default 2 MiB; the paper used 40 MB),
            rounded up to the device's 2 MiB granularity.
        capacity: device bytes (default the GPU's memory).
        steal_before_create: the chunk-placement virtual allocator reuses its free cached chunks
            before creating new ones (default True here, so that its reserved bytes show what
            the schedule needs rather than growing lazily to the capacity).
        release_completed: release a swap-out's memory as soon as its copy has completed (by
            the host's issue time), not only at its ``wait_swap_out``: TensorFlow's behaviour,
            which LMS schedules assume (default: True for ``scheduler == "lms"``).
        timeline: keep per-event intervals and memory samples (for :mod:`~vmalloc.offload.simulation.timeline`).
        iterations: iterations run on the same allocator; the last is reported (default 2).
        reference: ``(batch, images/s)`` of the in-core limit on this GPU
            (:func:`~vmalloc.offload.planning.planner.in_core_reference`): with it ``relative_speed`` is
            the paper's ratio, images/s over the in-core images/s at the in-core limit, and
            ``in_core_images_per_second`` is quoted only for a batch at or under the limit.
            Without it ``relative_speed`` is None and the in-core speed at this batch is quoted
            only when the sequence's in-core peak fits the capacity.

    Virtual-address mapping calls cost host time (see :class:`_Memory`; ``va_costs=False``
    makes them free): ``va_seconds`` and ``va_calls`` report them. ``link`` names the link model the copy times used.

    Out-of-memory is reported in the result (``out_of_memory``, ``oom_function``,
    ``oom_message`` with the allocator's state), not raised.
    """
    gpu = get_gpu(gpu)
    if allocator not in ALLOCATORS:
        raise InvalidArgumentError(
            f"unknown allocator {allocator!r}; choose from {', '.join(ALLOCATORS)}")
    if schedule is None:
        schedule = _in_core_schedule(seq)
    # under recompute the steps are those of the expanded sequence (re-run functions inserted)
    seq = schedule.sequence_of(seq)
    if len(schedule.steps) != len(seq.functions):
        raise InvalidArgumentError(
            f"the schedule has {len(schedule.steps)} steps for {len(seq.functions)} functions")
    chunk = None
    if allocator != "caching":
        chunk = DEFAULT_CHUNK if chunk_size is None else parse_size(chunk_size, "chunk_size")
        chunk = max(GRANULARITY, -(-chunk // GRANULARITY) * GRANULARITY)   # "40MB" -> 40 MiB
    cap = gpu.memory_bytes if capacity is None else parse_size(capacity, "capacity")
    if not isinstance(iterations, int) or iterations < 1:
        raise InvalidArgumentError(f"iterations must be a positive int, got {iterations!r}")

    device = allocator_kinds.accounting_device(cap, "2MiB")
    alloc = allocator_kinds.make_allocator(allocator, device, chunk_size=chunk,
                                           steal_before_create=steal_before_create)
    stable = allocator == "virtual" and hasattr(alloc, "unmap_backing")
    durations = function_seconds(seq, gpu)
    if release_completed is None:
        release_completed = schedule.scheduler == "lms"
    mem = _Memory(alloc, seq, stable, False, device if va_costs else None)
    oom = None
    run = None
    try:
        for v in sorted(schedule.initial_resident):
            mem.where = (None, "initial_resident")
            mem.acquire(v, 0.0)
        for it in range(iterations):
            last = it == iterations - 1
            if last:
                alloc.reset_peak_stats()
                mem.reset_costs()
                if timeline:
                    mem.samples = []
                    mem._sample(0.0)
            run = _run_iteration(seq, schedule, gpu, durations, mem, timeline and last,
                                 release_completed)
    except _OOM as e:
        oom = (mem.where, str(e))

    compute = math.fsum(durations)
    rc = schedule.recompute
    recompute_s = math.fsum(durations[k] for k in rc.origin) if rc is not None else 0.0
    in_core = compute - recompute_s
    if gpu.host_seconds:   # pytorch-eager: the launches bound the compute-only time too
        from vmalloc.offload.simulation.profiles import host_chain_seconds

        origin = rc.origin if rc is not None else ()
        compute = host_chain_seconds(durations, gpu.host_seconds)
        in_core = host_chain_seconds([d for k, d in enumerate(durations) if k not in origin],
                                     gpu.host_seconds)
    batch = seq.batch
    stats = alloc.stats()
    out_bytes = schedule.swap_out_bytes(seq)
    in_bytes = schedule.swap_in_bytes(seq)
    bound = max(compute, _xfer(out_bytes, gpu.d2h_bandwidth), _xfer(in_bytes, gpu.h2d_bandwidth))
    # swap-outs (forward) and swap-ins (backward) of a training step mostly cannot overlap:
    # the serial bound adds the two directions' transfer times
    serial = max(compute, _xfer(out_bytes, gpu.d2h_bandwidth) + _xfer(in_bytes, gpu.h2d_bandwidth))
    ips_compute = batch / in_core if batch and in_core > 0 else None
    limit_b = limit_ips = None
    if reference is not None:
        limit_b, limit_ips = reference
        runs_in_core = bool(batch) and bool(limit_b) and batch <= limit_b
    else:
        runs_in_core = seq.in_core_peak() <= cap
    res = SimulationResult(
        model=seq.name, batch=batch, gpu=gpu.name, scheduler=schedule.scheduler,
        allocator=allocator, chunk_size=chunk, params=dict(schedule.params),
        iteration_seconds=None, images_per_second=None, in_core_seconds=in_core,
        in_core_images_per_second=None, relative_speed=None, compute_seconds=compute,
        stall_seconds={"swap_in": 0.0, "swap_out": 0.0, "tail": 0.0},
        bound_seconds=bound, bound_ratio=None,
        serial_bound_seconds=serial, serial_bound_ratio=None,
        peak_requested_bytes=stats.peak_requested_bytes,
        peak_reserved_bytes=stats.peak_reserved_bytes,
        budget_bytes=schedule.budget if schedule.budget is not None else cap,
        capacity_bytes=cap, swapped_out_bytes=out_bytes, swapped_in_bytes=in_bytes,
        h2d_seconds=0.0, d2h_seconds=0.0, out_of_memory=oom is not None,
        link=link_description(gpu), in_core_limit_batch=limit_b,
        in_core_limit_images_per_second=limit_ips,
        compute_only_images_per_second=ips_compute,
        va_seconds=mem.va_seconds, va_calls=mem.va_calls,
        recomputed_functions=schedule.recomputed_functions(), recompute_seconds=recompute_s,
        compression=schedule.compression if schedule.compressed else None,
        profile=gpu.profile, precision=gpu.precision)
    if runs_in_core:
        # the compute-only time is the in-core time when the batch fits with no swaps
        res.in_core_images_per_second = ips_compute
    if oom is not None:
        (index, name), message = oom
        res.oom_function = {"index": index, "name": name}
        res.oom_message = message
        return res
    t, stalls, h2d, d2h, tl = run
    res.iteration_seconds = t
    res.stall_seconds = stalls
    res.h2d_seconds = h2d
    res.d2h_seconds = d2h
    if batch and t > 0:
        res.images_per_second = batch / t
        if limit_ips:
            res.relative_speed = res.images_per_second / limit_ips
    if t > 0:
        res.speed_vs_compute_only = res.same_batch_compute_ratio = in_core / t
    res.bound_ratio = t / bound if bound > 0 else 1.0
    res.serial_bound_ratio = t / serial if serial > 0 else 1.0
    if timeline:
        tl["memory"] = mem.samples
        tl["budget"] = res.budget_bytes
        tl["capacity"] = cap
        res.timeline = tl
    return res


def _xfer(nbytes, bw):
    return 0.0 if nbytes == 0 or math.isinf(bw) else nbytes / bw


def _run_iteration(seq, schedule, gpu, durations, mem, record, release_completed=False):
    h2d = _Engine(gpu.h2d_bandwidth, gpu.bidirectional_bandwidth)
    d2h = _Engine(gpu.d2h_bandwidth, gpu.bidirectional_bandwidth)
    var = seq.variables
    compressed = schedule.compressed
    host = gpu.host_seconds

    def moved(v):
        n = var[v].nbytes
        return n // 2 if v in compressed else n

    def cast(v):
        # fp16/bf16 compression: read 4 bytes, write 2 per element, in device memory
        return 1.5 * var[v].nbytes / gpu.hbm_bandwidth if v in compressed else 0.0
    # variable -> state: "host", "device", "out" (swap-out in flight, memory still held)
    on_device = set(schedule.initial_resident)
    out_end: Dict[int, float] = {}     # end of the variable's last swap-out copy
    in_end: Dict[int, float] = {}      # end of the variable's last swap-in copy
    pending_out = set()
    completed = deque()   # (copy end, variable) of swap-outs, in engine (FIFO) order
    c = 0.0          # compute stream free
    h = 0.0          # host issue time
    stalls = {"swap_in": 0.0, "swap_out": 0.0, "tail": 0.0}
    compute_iv, h2d_iv, d2h_iv = [], [], []
    for i, (f, step) in enumerate(zip(seq.functions, schedule.steps)):
        mem.where = (i, f.name)
        h0 = h
        if release_completed:
            while completed and completed[0][0] <= h:
                _, v = completed.popleft()
                if v in pending_out and out_end.get(v) is not None:
                    pending_out.discard(v)
                    on_device.discard(v)
                    h += mem.release(v, h, swap=True)
        for v in step.drop:
            # the host copy is valid: the memory goes with no copy (pointer-stable like a
            # swap-out, since a swap-in brings it back)
            if v in on_device and v not in pending_out:
                on_device.discard(v)
                h += mem.release(v, h, swap=True)
        for v in step.wait_swap_out:
            h = max(h, out_end.get(v, 0.0))
            if v in pending_out:
                pending_out.discard(v)
                on_device.discard(v)
                h += mem.release(v, h, swap=True)
        for v in step.allocate:
            if v not in on_device:
                h += mem.acquire(v, h)
                on_device.add(v)
        for v in step.swap_in:
            if v in pending_out:      # its swap-out not yet waited: the device copy is valid
                pending_out.discard(v)
                continue
            if v in on_device:
                continue
            h += mem.acquire(v, h)
            on_device.add(v)
            s, e = h2d.copy(max(h, out_end.get(v, 0.0)), moved(v), d2h, cast(v))
            in_end[v] = e
            if record:
                h2d_iv.append((s, e, v))
        h += host   # the launch of function i (pytorch-eager; 0 under nnabla)
        t1 = max(c, h)
        stalls["swap_out"] += t1 - max(c, h0 + host)
        start = t1
        for v in step.wait_swap_in:
            start = max(start, in_end.get(v, 0.0))
        stalls["swap_in"] += start - t1
        end = start + durations[i]
        if record:
            compute_iv.append((start, end, i))
        c = end
        h = max(h, start)   # the host runs one function ahead
        for v in step.free:
            pending_out.discard(v)
            if v in on_device:
                on_device.discard(v)
                h += mem.release(v, h)
        for v in step.swap_out:
            s, e = d2h.copy(end, moved(v), h2d, cast(v))
            out_end[v] = e
            pending_out.add(v)
            if release_completed:
                completed.append((e, v))
            if record:
                d2h_iv.append((s, e, v))
    mem.where = (len(seq.functions), "end_wait_swap_out")
    t_end = c
    for v in schedule.end_wait_swap_out:
        h = max(h, out_end.get(v, 0.0))
        if v in pending_out:
            pending_out.discard(v)
            on_device.discard(v)
            h += mem.release(v, h, swap=True)
    for v in schedule.end_drop:
        if v in on_device and v not in pending_out:
            on_device.discard(v)
            h += mem.release(v, h, swap=True)
    t_end = max(t_end, h, h2d.free_at, d2h.free_at)
    stalls["tail"] = t_end - c
    # anything left that should not be (a schedule that forgot a free) goes at the end;
    # a persistent variable that should be resident and is not comes back
    resident = schedule.initial_resident
    for v in sorted(on_device):
        if v in pending_out or v not in resident:
            mem.release(v, t_end, swap=v in pending_out)
            on_device.discard(v)
    for v in sorted(resident - on_device):
        mem.acquire(v, t_end)
    tl = None
    if record:
        tl = {"compute": compute_iv, "h2d": h2d_iv, "d2h": d2h_iv, "iteration_seconds": t_end}
    return t_end, stalls, h2d.busy, d2h.busy, tl


def _in_core_schedule(seq):
    """Everything resident: persistent variables from the start, transients allocated before
    first use, freed after last use."""
    from vmalloc.offload.scheduling.schedule import Schedule, Step

    steps = [Step() for _ in seq.functions]
    uses = seq.uses()
    for v in seq.variables:
        u = uses[v.id]
        if v.persistent or not u:
            continue
        steps[u[0]].allocate.append(v.id)
        steps[u[-1]].free.append(v.id)
    resident = frozenset(v.id for v in seq.variables if v.persistent)
    return Schedule("none", steps, initial_resident=resident)
