"""Planning by simulation: a scheduler's parameters (window, recompute, batch) chosen by
simulating them (``planner``, reported by ``plan_report``), and the simulator validated against
the published rows at their planned settings (``validate``). On top of ``simulation``
(docs/architecture.rst, "The offload package")."""
