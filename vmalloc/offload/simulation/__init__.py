"""The simulator: a schedule run on a model of a GPU, time modelled and every allocation made
by a real vmalloc allocator (``simulator``, ``sim_memory``, ``timeline``), the framework
profiles and precisions of a GPU model (``profiles``) and the published figures they are
calibrated on (``published``). Uses ``scheduling``, ``sequence`` and ``hardware``, never the
runtime (docs/architecture.rst, "The offload package")."""
