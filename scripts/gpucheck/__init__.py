"""scripts/gpu-check: the proof on a real GPU in one command (docs/gpu_check.rst).

The runner (:mod:`gpucheck.run`) imports nothing of vmalloc: it builds vmalloc first, then runs
each section in a child process (:mod:`gpucheck.section`) with its own time limit, so that a
crash, a hang or a failure in one section is recorded in the report and the next one runs.
"""
