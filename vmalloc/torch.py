"""Using a vmalloc allocator as PyTorch's CUDA memory allocator.

::

    import vmalloc, vmalloc.torch
    vmalloc.torch.use_vmalloc(vmalloc.VirtualAllocator(vmalloc.CudaDevice(0)))
    x = torch.zeros(1024, 1024, device="cuda")   # memory from the vmalloc allocator
    print(vmalloc.torch.memory_stats(0))

PyTorch loads libvmalloc.so as a ``torch.cuda.memory.CUDAPluggableAllocator`` and calls its C
functions ``vmalloc_torch_alloc`` / ``vmalloc_torch_free`` for every CUDA tensor, with the
tensor's device and stream; those route to the device's current vmalloc allocator
(:func:`vmalloc.set_current_allocator`). No Python runs per allocation.

PyTorch can swap its allocator only before CUDA is initialized, so call :func:`use_vmalloc`
before the first CUDA tensor. Importing this module never needs PyTorch; using it without
PyTorch raises an ImportError that says so.
"""

import sys
import threading

from vmalloc._core import current_allocator as _current_allocator
from vmalloc._core.current_allocator import library_path
from vmalloc._core.device_map import as_device_map
from vmalloc.errors import OutOfMemoryError, VmallocError

__all__ = [
    "CompilePolicy",
    "OutOfCore",
    "check_out_of_memory",
    "compile_out_of_core",
    "is_installed",
    "memory_snapshot",
    "memory_stats",
    "memory_summary",
    "offloading_config",
    "out_of_core",
    "policy",
    "pluggable_allocator",
    "reset_peak_memory_stats",
    "use_vmalloc",
]

_lock = threading.Lock()
_pluggable = None
_installed = False
_oom_seen = {}  # (device, id(allocator)) -> out_of_memory_count already accounted for


def _torch():
    try:
        import torch
    except ImportError as error:
        raise ImportError(f"vmalloc.torch needs PyTorch (pip install torch): {error}") from error
    return torch


def _torch_with_cuda():
    torch = _torch()
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(
            f"PyTorch {torch.__version__} was built without CUDA (torch.version.cuda is "
            f"{torch.version.cuda}); vmalloc.torch needs a CUDA build of PyTorch")
    return torch


def pluggable_allocator():
    """The ``torch.cuda.memory.CUDAPluggableAllocator`` over libvmalloc.so (made once).

    Its ``record_stream`` hook makes a tensor's free wait for the streams it was recorded on,
    and its reset hook makes ``torch.cuda.empty_cache()`` release every device's cached
    memory. Use it with ``torch.cuda.MemPool`` to route only some allocations to vmalloc;
    :func:`use_vmalloc` installs it for all. Raises RuntimeError for a PyTorch without CUDA.
    """
    global _pluggable
    torch = _torch_with_cuda()
    with _lock:
        if _pluggable is None:
            pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), "vmalloc_torch_alloc", "vmalloc_torch_free")
            hooks = pluggable.allocator()
            if hasattr(hooks, "set_record_stream_fn"):
                hooks.set_record_stream_fn(
                    _current_allocator.function_address("vmalloc_torch_record_stream"))
            if hasattr(hooks, "set_reset_fn"):
                hooks.set_reset_fn(_current_allocator.function_address("vmalloc_torch_empty_cache"))
            _pluggable = pluggable
        return _pluggable


def use_vmalloc(allocators):
    """Makes vmalloc PyTorch's CUDA allocator for the rest of the process.

    ``allocators`` is one :class:`vmalloc.Allocator` (serving the CUDA device of its own
    ordinal) or a ``{device: Allocator}`` mapping (ints, ``"cuda:1"`` or ``torch.device``);
    each becomes that device's current vmalloc allocator. The first call installs
    :func:`pluggable_allocator` with ``torch.cuda.memory.change_current_allocator``; later
    calls only change the current allocators (tensors already allocated still go back to the
    allocator that made them).

    Raises RuntimeError, before changing anything, when PyTorch has no CUDA or has already
    initialized CUDA (and with it its own allocator), which PyTorch cannot undo.
    """
    global _installed
    mapping = as_device_map(allocators, _device_index)
    torch = _torch_with_cuda()
    with _lock:
        installed = _installed
    if not installed and torch.cuda.is_initialized():
        raise RuntimeError(
            "PyTorch has already initialized CUDA and its own caching allocator, which it "
            "cannot swap afterwards: call vmalloc.torch.use_vmalloc() before creating any CUDA "
            "tensor or calling torch.cuda functions that initialize CUDA")
    pluggable = None if installed else pluggable_allocator()
    previous = {}
    try:
        for device, allocator in mapping.items():
            previous[device] = _current_allocator.set_current_allocator(allocator, device)
            _remember_out_of_memory_count(device, allocator)
        if pluggable is not None:
            try:
                torch.cuda.memory.change_current_allocator(pluggable)
            except RuntimeError as error:
                raise RuntimeError(
                    f"PyTorch refused to switch to the vmalloc allocator ({error}); call "
                    f"vmalloc.torch.use_vmalloc() before anything initializes CUDA") from error
            with _lock:
                _installed = True
    except BaseException:
        for device, allocator in previous.items():
            _current_allocator.set_current_allocator(allocator, device)
        raise


def is_installed():
    """True once :func:`use_vmalloc` made vmalloc PyTorch's CUDA allocator in this process."""
    return _installed


def _device_index(device):
    """A CUDA ordinal from None (the current device), an int, ``"cuda"``, ``"cuda:1"`` or a
    ``torch.device``."""
    if device is None:
        torch = sys.modules.get("torch")  # never import torch just to learn the device
        if torch is not None and getattr(torch.version, "cuda", None) is not None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return torch.cuda.current_device()
        return 0
    if isinstance(device, bool):
        raise TypeError("device must be an int, 'cuda:N' or a torch.device, got a bool")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise ValueError(f"expected a CUDA device such as 'cuda:0', got {device!r}")
        return int(index) if index else _device_index(None)
    kind = getattr(device, "type", None)
    if kind is not None:  # torch.device
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device}")
        return device.index if device.index is not None else _device_index(None)
    raise TypeError(f"device must be an int, 'cuda:N' or a torch.device, "
                    f"got {type(device).__name__}")


def _allocator_of(device):
    index = _device_index(device)
    allocator = _current_allocator.get_current_allocator(index)
    if allocator is None:
        raise VmallocError(f"device {index} has no current vmalloc allocator; set one with "
                           f"vmalloc.torch.use_vmalloc() or vmalloc.set_current_allocator()")
    return index, allocator


def memory_stats(device=None):
    """The :class:`vmalloc.Stats` of ``device``'s current vmalloc allocator.

    With a pluggable allocator, PyTorch's own ``torch.cuda.memory_stats()`` (and what is built
    on it: ``memory_allocated()``, ``max_memory_allocated()``, ``memory_reserved()``,
    ``memory_summary()``) raises ``RuntimeError`` in current PyTorch (the pluggable allocator
    has no device statistics); this is the replacement. ``device`` is None (the current CUDA device), an int, ``"cuda:1"`` or a
    ``torch.device``. Raises :class:`vmalloc.VmallocError` when the device has no current
    allocator.
    """
    return _allocator_of(device)[1].stats()


def memory_summary(device=None):
    """A readable table of ``device``'s current vmalloc allocator's statistics, in the manner
    of ``torch.cuda.memory_summary()`` (which raises under a pluggable allocator)."""
    from vmalloc._core.stats import format_memory_summary

    index, allocator = _allocator_of(device)
    return format_memory_summary(allocator.stats(), index)


def memory_snapshot(device=None):
    """The allocation history of ``device``'s current allocator, a
    :class:`vmalloc.LoggingAllocator`, as the dict ``torch.cuda.memory._snapshot()`` returns;
    write it with ``pickle`` (or :func:`vmalloc.traces.torch_export.write_snapshot`) to open it
    in PyTorch's memory viewer. See :mod:`vmalloc.traces.torch_export`."""
    from vmalloc.traces.torch_export import allocator_snapshot

    index, allocator = _allocator_of(device)
    return allocator_snapshot(allocator, index)


def reset_peak_memory_stats(device=None):
    """Sets every peak statistic of ``device``'s current vmalloc allocator to its current value."""
    _allocator_of(device)[1].reset_peak_stats()


def _remember_out_of_memory_count(device, allocator):
    with _lock:
        _oom_seen[(device, id(allocator))] = allocator.stats().out_of_memory_count


def check_out_of_memory(device=None):
    """Raises :class:`vmalloc.OutOfMemoryError` if an allocation on ``device`` failed since
    the last check.

    PyTorch does not check what a pluggable allocator returns: a failed allocation becomes a
    tensor at address 0, and the first kernel touching it fails with an illegal memory
    access. Call this after a step (or when a CUDA error appears) to learn that vmalloc ran
    out of memory; the error carries the allocator's ``.stats``.
    """
    index, allocator = _allocator_of(device)
    stats = allocator.stats()
    with _lock:
        seen = _oom_seen.get((index, id(allocator)), 0)
        _oom_seen[(index, id(allocator))] = stats.out_of_memory_count
    if stats.out_of_memory_count > seen:
        failures = stats.out_of_memory_count - seen
        error = OutOfMemoryError(
            f"{failures} allocation(s) on device {index} ran out of memory in the vmalloc "
            f"allocator (PyTorch received null pointers for them)")
        error.stats = stats
        raise error


def out_of_core(budget=None, scheduler="window", window=None, backend=None, min_bytes=64 << 10,
                device=None, allocator=None, persistent="auto", strict=False, recompute=False,
                compress=None):
    """Out-of-core training of the training steps run inside ``with`` (one call turns it on)::

        vmalloc.torch.use_vmalloc(vmalloc.VirtualAllocator(vmalloc.CudaDevice(0)))
        ...
        with vmalloc.torch.out_of_core(budget="12GiB") as ooc:
            for x, y in loader:
                loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()

    A ``TorchDispatchMode`` reports each op's storages to a :class:`vmalloc.offload.Runtime`,
    which records the first iteration, schedules it (window scheduler by default) and swaps
    storages between the GPU and pinned host memory on dedicated streams at op boundaries.
    ``backend="poison"`` runs the same logic on CPU tensors (see
    :mod:`vmalloc.frameworks.torch_out_of_core`). ``persistent`` defaults to ``"auto"``, as
    in every driver; ``strict=True`` raises when no schedule fits the budget (otherwise that
    is said once, with a warning). ``recompute=True``: storages written by deterministic
    functional ops may be dropped and recomputed (the op re-dispatched) instead of swapped,
    where that moves fewer bytes (docs/runtime.rst, "Recompute"). ``compress="fp16"`` or
    ``"bf16"`` (opt-in, lossy) swaps float32 activations at half their bytes. Returns the
    :class:`OutOfCore` context manager.
    """
    from vmalloc.frameworks.torch_out_of_core import out_of_core as _out_of_core
    return _out_of_core(budget=budget, scheduler=scheduler, window=window, backend=backend,
                        min_bytes=min_bytes, device=device, allocator=allocator,
                        persistent=persistent, strict=strict, recompute=recompute,
                        compress=compress)


def policy(model, example, loss_fn=None, budget=None, link_gbps=None, optimizer="sgd",
           gpu="v100-16gb", strict=False):
    """vmalloc's plan for *compiled* training as a selective-checkpoint policy::

        plan = vmalloc.torch.policy(model, (x, y), loss_fn=loss_fn, budget="6GiB")
        step_model = vmalloc.torch.compile_out_of_core(model, plan)   # torch.compile inside
        loss_fn(step_model(x), y).backward()

    Records one iteration on the meta device, plans it under ``budget`` with a link of
    ``link_gbps`` GB/s (None: measured on CUDA, a documented constant on CPU), and maps each
    activation to ``MUST_CPU_OFFLOAD``, ``MUST_RECOMPUTE`` or ``MUST_SAVE``. Returns a
    :class:`CompilePolicy`; ``checkpoint(..., context_fn=plan.context_fn)`` uses it. See
    :mod:`vmalloc.frameworks.torch_compile`.
    """
    from vmalloc.frameworks.torch_compile import policy as _policy
    return _policy(model, example, loss_fn=loss_fn, budget=budget, link_gbps=link_gbps,
                   optimizer=optimizer, gpu=gpu, strict=strict)


def compile_out_of_core(model, plan, backend="inductor", **options):
    """``torch.compile`` of ``model``'s forward checkpointed under ``plan`` (a
    :class:`CompilePolicy`), called with :func:`offloading_config` on. Returns a module
    sharing ``model``'s parameters."""
    from vmalloc.frameworks.torch_compile import compile_out_of_core as _compile
    return _compile(model, plan, backend=backend, **options)


def offloading_config(link_gbps=None):
    """The ``torch._functorch.config`` settings that lower ``MUST_CPU_OFFLOAD`` into offload /
    reload ops (see :func:`vmalloc.frameworks.torch_compile.offloading_config`)."""
    from vmalloc.frameworks.torch_compile import offloading_config as _config
    return _config(link_gbps)


def __getattr__(name):
    if name == "OutOfCore":
        from vmalloc.frameworks.torch_out_of_core import OutOfCore
        return OutOfCore
    if name == "CompilePolicy":
        from vmalloc.frameworks.torch_compile import CompilePolicy
        return CompilePolicy
    raise AttributeError(f"module 'vmalloc.torch' has no attribute {name!r}")

