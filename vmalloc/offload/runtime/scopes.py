"""The context managers of :meth:`Runtime.iteration` and :meth:`Runtime.function`: each calls
the protocol's begin/end (enter/exit) pair, ending failed when the block raised."""

from __future__ import annotations


class _Iteration:
    __slots__ = ("rt",)

    def __init__(self, rt):
        self.rt = rt

    def __enter__(self):
        self.rt.begin_iteration()
        return self.rt

    def __exit__(self, exc_type, exc, tb):
        self.rt.end_iteration(failed=exc_type is not None)
        return False


class _Function:
    __slots__ = ("rt", "reads", "writes", "name", "rerun")

    def __init__(self, rt, reads, writes, name, rerun):
        self.rt = rt
        self.reads = reads
        self.writes = writes
        self.name = name
        self.rerun = rerun

    def __enter__(self):
        return self.rt.enter_function(self.reads, self.writes, self.name, self.rerun)

    def __exit__(self, exc_type, exc, tb):
        self.rt.exit_function(failed=exc_type is not None)
        return False


