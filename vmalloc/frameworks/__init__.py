"""Framework drivers: the glue between a framework (PyTorch, CuPy, nnabla) and vmalloc, one
module per framework, each with the same shape: ``use_vmalloc(...)`` where the framework can
take an allocator, and ``out_of_core(budget=..., scheduler=..., window=..., persistent=...)``
returning a context manager with ``stats()``, over one :class:`vmalloc.offload.Runtime`."""
