"""The framework drivers of the out-of-core Runtime: one module per framework, each a thin
driver over :class:`vmalloc.offload.Runtime`'s public protocol (PyTorch, CuPy, nnabla)."""
