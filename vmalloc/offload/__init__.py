"""Out-of-core training: swap tensors between device and pinned host memory on a schedule.

After Hayakawa & Narihira, *Out-of-core training for extremely large-scale neural networks
with adaptive window-based scheduling*:

- :class:`SwapManager` moves allocations between device memory and pinned host staging memory
  on dedicated transfer streams; on the virtual allocator the pointer never changes.
- :class:`FunctionSequence` is one training iteration (functions and the variables they read
  and write), built in code, loaded from a file, or recorded from PyTorch.
- Schedulers (:class:`WindowScheduler`, :class:`LMSScheduler`, :class:`VDNNScheduler`,
  :class:`InCoreScheduler`) turn a sequence into a :class:`Schedule`.
- :class:`PageStream` streams pages of host data (arrays, files) to the device through the
  manager's pinned staging, for data larger than the device.
- :func:`simulate` runs a schedule on a model of a GPU, every allocation through a real vmalloc
  allocator; :func:`plan` picks a scheduler's parameters by simulation.

Names are imported on first use, so ``import vmalloc.offload`` stays cheap.
"""

import importlib

# name -> submodule that defines it
_EXPORTS = {
    "SwapManager": "_swap_manager",
    "FunctionSequence": "sequence",
    "Variable": "sequence",
    "Function": "sequence",
    "SequenceFormatError": "sequence",
    "Schedule": "schedule",
    "Step": "schedule",
    "ScheduleError": "schedule",
    "WindowScheduler": "window",
    "LMSScheduler": "lms",
    "VDNNScheduler": "vdnn",
    "InCoreScheduler": "in_core",
    "make_scheduler": "schedulers",
    "SCHEDULERS": "schedulers",
    "simulate": "simulator",
    "SimulationResult": "simulator",
    "GPU": "gpus",
    "GPUS": "gpus",
    "get_gpu": "gpus",
    "profiled_gpu": "profiles",
    "apply_precision": "profiles",
    "PROFILES": "profiles",
    "PRECISIONS": "profiles",
    "validate": "validate",
    "plan": "planner",
    "Plan": "planner",
    "max_batch": "planner",
    "model_sequence": "models",
    "MODELS": "models",
    "Runtime": "runtime",
    "Buffer": "runtime",
    "BudgetWarning": "runtime",
    "record": "recorder",
    "RecordingError": "recorder",
    "PageStream": "pages",
    "PageError": "pages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vmalloc.offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vmalloc.offload.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
