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

Names are imported on first use, so ``import vmalloc.offload`` stays cheap. The modules live
in one folder per concern (``swap``, ``sequence``, ``hardware``, ``scheduling``, ``simulation``,
``runtime``, ``planning``, ``cli``), layered one way (docs/architecture.rst, "The offload
package"); this module only re-exports their public names.
"""

import importlib

# name -> submodule that defines it
_EXPORTS = {
    "SwapManager": "swap",
    "FunctionSequence": "sequence.sequence",
    "Variable": "sequence.sequence",
    "Function": "sequence.sequence",
    "SequenceFormatError": "sequence.sequence",
    "Schedule": "scheduling.schedule",
    "Step": "scheduling.schedule",
    "ScheduleError": "scheduling.schedule",
    "WindowScheduler": "scheduling.window",
    "LMSScheduler": "scheduling.lms",
    "VDNNScheduler": "scheduling.vdnn",
    "InCoreScheduler": "scheduling.in_core",
    "make_scheduler": "scheduling.schedulers",
    "SCHEDULERS": "scheduling.schedulers",
    "simulate": "simulation.simulator",
    "SimulationResult": "simulation.simulator",
    "GPU": "hardware.gpus",
    "GPUS": "hardware.gpus",
    "get_gpu": "hardware.gpus",
    "profiled_gpu": "simulation.profiles",
    "apply_precision": "simulation.profiles",
    "PROFILES": "simulation.profiles",
    "PRECISIONS": "simulation.profiles",
    "validate": "planning.validate",
    "plan": "planning.planner",
    "Plan": "planning.planner",
    "max_batch": "planning.planner",
    "model_sequence": "sequence.models",
    "MODELS": "sequence.models",
    "Runtime": "runtime",
    "Buffer": "runtime",
    "BudgetWarning": "runtime",
    "record": "sequence.recorder",
    "RecordingError": "sequence.recorder",
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
