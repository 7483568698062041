"""Function sequences: one training iteration as the functions it runs and the variables they
read and write (``sequence``, saved and loaded by ``_sequence_file``), recorded from PyTorch
(``recorder``, with the aten-op rules of ``aten_ops``), and the shipped recorded models
(``models``, ``data/``; ``torch_models`` builds them). The bottom of the offload folders beside
``swap`` and ``hardware`` (docs/architecture.rst, "The offload package")."""
