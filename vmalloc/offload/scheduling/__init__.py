"""Schedulers: a function sequence turned into a schedule of swap-outs, swap-ins, waits and
recomputations (``schedule``): the paper's window scheduler (``window``, its main loop compiled
in ``_window_loop.pyx``), the LMS and vDNN baselines (``lms``, ``vdnn``), in-core
(``in_core``), recompute (``recompute``) and the table of names (``schedulers``). Uses
``sequence`` and ``hardware`` (docs/architecture.rst, "The offload package")."""
