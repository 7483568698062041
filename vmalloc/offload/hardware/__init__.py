"""Models of GPUs (``gpus``): memory, link bandwidths and compute rates. Below scheduling,
because what is worth recomputing depends on a GPU's compute and link times (the recompute
choice of ``scheduling.recompute`` and the runtime's ``gpu=``), and below the simulator, which
runs schedules on them (docs/architecture.rst, "The offload package")."""
