"""Function sequences: one training iteration as the paper sees it.

Hayakawa & Narihira schedule swaps over the *function sequence* (the functions of one
iteration in execution order) and the *variable sequence* (the variables each function reads
and writes). A :class:`FunctionSequence` holds both: variables with a size and a kind
(persistent across iterations, such as parameters and optimizer state, or transient, such as
activations and gradients), and functions with the variables they read (``inputs``) and write
(``outputs``) and an optional cost (FLOPs or measured seconds).

A transient variable lives from its first use to its last use within the iteration; a
persistent one lives across iterations. An output that is not also an input is *write-only*
at that function: its old content is dead, so a scheduler never needs to bring it in.

Sizes and FLOPs may scale with the batch: a variable's bytes are
``nbytes + per_sample_bytes * (b - batch)`` at batch ``b`` (likewise FLOPs), so one recorded
sequence serves every batch size (:meth:`FunctionSequence.at_batch`).

The file format (``save``/``load``; gzip when the name ends in ``.gz``) is documented in
``docs/function_sequences.rst``.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Iterable, List, NamedTuple, Optional

from vmalloc.errors import InvalidArgumentError, VmallocError
from vmalloc.sizes import MAX_SIZE, parse_size

FORMAT = "vmalloc-function-sequence"
VERSION = 1
#: A sequence file larger than this (decompressed) is refused as soon as its text passes it:
#: 256 MiB holds ~5 x 10^6 functions, and loading takes at most ~10x its text in memory.
MAX_FILE_BYTES = 256 << 20
#: The most values (numbers, strings, ids) the records of a file may hold together, counted
#: before they are decoded: a gzip of 200 KB expands to 20 million tiny records, gigabytes of
#: Python objects. The shipped models hold under 40,000; this allows ~50x that.
MAX_RECORD_VALUES = 1 << 21
#: The largest cost a function may give (seconds; FLOPs per function or per sample are bounded
#: by MAX_FUNCTION_FLOPS): sums of a few such stay finite, where 1e308 made the simulator's
#: sums overflow.
MAX_FUNCTION_SECONDS = 1e6
MAX_FUNCTION_FLOPS = 1e24


class SequenceFormatError(VmallocError, ValueError):
    """A function-sequence file that cannot be read: not the format, corrupt or hostile.

    Attributes:
        path: the file, as given (None for in-memory data).
        record: where the problem is, e.g. ``"functions[12]"``, or None for the whole file.
    """

    def __init__(self, message, path=None, record=None):
        where = ""
        if path is not None:
            where = f"{path}: "
        if record is not None:
            where += f"{record}: "
        super().__init__(where + message)
        self.path = path
        self.record = record


class Variable(NamedTuple):
    """A variable (a tensor's storage) of the sequence."""

    id: int
    nbytes: int
    persistent: bool
    name: str
    per_sample_bytes: int = 0


class Function(NamedTuple):
    """A function of the sequence: what it reads and writes, and its cost."""

    index: int
    name: str
    inputs: tuple      # variable ids read (in-place outputs appear here too)
    outputs: tuple     # variable ids written
    flops: Optional[float] = None
    seconds: Optional[float] = None
    per_sample_flops: float = 0.0

    @property
    def uses(self):
        """Every variable the function touches, inputs first, each once."""
        seen = dict.fromkeys(self.inputs)
        seen.update(dict.fromkeys(self.outputs))
        return tuple(seen)

    @property
    def write_only(self):
        """Outputs that are not inputs: their old content is dead here."""
        ins = set(self.inputs)
        return tuple(v for v in dict.fromkeys(self.outputs) if v not in ins)


class FunctionSequence:
    """One iteration's functions in execution order and the variables they use.

    Build it in code::

        seq = FunctionSequence(name="mlp")
        w = seq.add_variable("4MiB", persistent=True, name="w")
        x = seq.add_variable(1 << 20)
        y = seq.add_variable(1 << 20)
        seq.add_function(inputs=[x, w], outputs=[y], flops=2e9, name="matmul")

    or record it from PyTorch (:mod:`vmalloc.offload.sequence.recorder`), or load a saved one.
    """

    def __init__(self, name: str = "", batch: Optional[int] = None, meta: Optional[dict] = None):
        self.name = name
        self.batch = batch
        self.meta = dict(meta or {})
        self.variables: List[Variable] = []
        self.functions: List[Function] = []
        self._uses = None  # cached per-variable use lists

    # --- building ---------------------------------------------------------------------
    def add_variable(self, nbytes, persistent: bool = False, name: Optional[str] = None,
                     per_sample_bytes: int = 0) -> int:
        """Adds a variable of ``nbytes`` (an int or a string such as ``"4MiB"``); returns its id."""
        n = parse_size(nbytes, "nbytes")
        ps = parse_size(per_sample_bytes, "per_sample_bytes")
        if not isinstance(persistent, bool):
            raise InvalidArgumentError(f"persistent must be a bool, got {persistent!r}")
        vid = len(self.variables)
        self.variables.append(Variable(vid, n, persistent, name or f"v{vid}", ps))
        self._uses = None
        return vid

    def add_function(self, inputs: Iterable[int] = (), outputs: Iterable[int] = (),
                     flops: Optional[float] = None, seconds: Optional[float] = None,
                     name: Optional[str] = None, per_sample_flops: float = 0.0) -> int:
        """Appends a function reading ``inputs`` and writing ``outputs`` (variable ids);
        returns its index. Raises InvalidArgumentError for an unknown variable or a negative
        cost, or one past MAX_FUNCTION_SECONDS / MAX_FUNCTION_FLOPS."""
        ins = tuple(self._check_var(v, "inputs") for v in inputs)
        outs = tuple(self._check_var(v, "outputs") for v in outputs)
        for what, value in (("flops", flops), ("seconds", seconds),
                            ("per_sample_flops", per_sample_flops)):
            if value is not None and (not isinstance(value, (int, float)) or value < 0
                                      or value != value):
                raise InvalidArgumentError(f"{what} must be a non-negative number, got {value!r}")
            bound = MAX_FUNCTION_SECONDS if what == "seconds" else MAX_FUNCTION_FLOPS
            if value is not None and value > bound:
                raise InvalidArgumentError(f"{what} must be at most {bound:g}, got {value!r}")
        index = len(self.functions)
        self.functions.append(Function(index, name or f"f{index}", ins, outs,
                                       None if flops is None else float(flops),
                                       None if seconds is None else float(seconds),
                                       float(per_sample_flops or 0.0)))
        self._uses = None
        return index

    def _check_var(self, v, what):
        if isinstance(v, Variable):
            v = v.id
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(self.variables):
            raise InvalidArgumentError(
                f"{what}: {v!r} is not a variable of this sequence (ids 0..{len(self.variables) - 1})")
        return v

    # --- queries ----------------------------------------------------------------------
    def __len__(self):
        return len(self.functions)

    def uses(self) -> List[List[int]]:
        """For each variable, the indices of the functions that use it, in order."""
        if self._uses is None:
            uses = [[] for _ in self.variables]
            for f in self.functions:
                for v in f.uses:
                    uses[v].append(f.index)
            self._uses = uses
        return self._uses

    def nbytes(self, vid: int) -> int:
        return self.variables[vid].nbytes

    def persistent_bytes(self) -> int:
        """Bytes of persistent variables (alive across iterations)."""
        return sum(v.nbytes for v in self.variables if v.persistent)

    def total_bytes(self) -> int:
        return sum(v.nbytes for v in self.variables)

    def total_flops(self) -> float:
        return sum(f.flops or 0.0 for f in self.functions)

    def in_core_peak(self) -> int:
        """Peak bytes live if nothing is swapped: persistent variables always, each transient
        one from its first to its last use (allocated before, freed after the function)."""
        uses = self.uses()
        born = [[] for _ in self.functions]
        dies = [[] for _ in self.functions]
        live = 0
        for v in self.variables:
            if v.persistent:
                live += v.nbytes
            elif uses[v.id]:
                born[uses[v.id][0]].append(v.nbytes)
                dies[uses[v.id][-1]].append(v.nbytes)
        peak = live
        for i in range(len(self.functions)):
            live += sum(born[i])
            peak = max(peak, live)
            live -= sum(dies[i])
        return peak

    def at_batch(self, batch: int) -> "FunctionSequence":
        """This sequence at another batch size (sizes and FLOPs scaled per sample)."""
        if self.batch is None:
            raise InvalidArgumentError(
                f"sequence {self.name!r} was not recorded with a batch size; it cannot be scaled")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgumentError(f"batch must be a positive int, got {batch!r}")
        d = batch - self.batch
        out = FunctionSequence(self.name, batch, self.meta)
        for v in self.variables:
            n = v.nbytes + v.per_sample_bytes * d
            if n < 0 or n > MAX_SIZE:
                raise InvalidArgumentError(
                    f"variable {v.name} would have {n} bytes at batch {batch}")
            out.variables.append(v._replace(nbytes=n))
        for f in self.functions:
            flops = f.flops
            if flops is not None:
                flops = max(0.0, flops + f.per_sample_flops * d)
            out.functions.append(f._replace(flops=flops))
        return out

    def summary(self) -> str:
        per = sum(1 for v in self.variables if v.persistent)
        from vmalloc.sizes import format_size
        return (f"{self.name or 'sequence'}"
                + (f" at batch {self.batch}" if self.batch is not None else "")
                + f": {len(self.functions)} functions, {len(self.variables)} variables "
                f"({per} persistent, {format_size(self.persistent_bytes())}), "
                f"in-core peak {format_size(self.in_core_peak())}, "
                f"{self.total_flops() / 1e12:.3g} TFLOP")

    def __repr__(self):
        return f"<FunctionSequence {self.summary()}>"

    # --- file format ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "batch": self.batch,
            "meta": self.meta,
            "variables": [[v.nbytes, v.per_sample_bytes, int(v.persistent), v.name]
                          for v in self.variables],
            "functions": [[f.name, list(f.inputs), list(f.outputs), f.flops,
                           f.per_sample_flops, f.seconds] for f in self.functions],
        }

    def save(self, path) -> None:
        """Writes the sequence as JSON (gzip-compressed when ``path`` ends in ``.gz``)."""
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        path = os.fspath(path)
        if path.endswith(".gz"):
            data = gzip.compress(data, mtime=0)
        with open(path, "wb") as f:
            f.write(data)

    @classmethod
    def load(cls, path) -> "FunctionSequence":
        """Reads a file written by :meth:`save`. Raises SequenceFormatError naming the file and
        the record for anything that is not a valid sequence, and for what is not a regular
        file (a FIFO). Reads at most MAX_FILE_BYTES (decompressed) and decodes one record at
        a time: memory is bounded by the text and the sequence (``_sequence_file``)."""
        from vmalloc.offload.sequence import _sequence_file

        path = os.fspath(path)
        text = _sequence_file.read_text(
            path, MAX_FILE_BYTES, lambda message: SequenceFormatError(message, path))
        try:
            obj = _sequence_file.parse(text, _variable, _function, MAX_RECORD_VALUES)
        except _sequence_file._Bad as bad:
            raise SequenceFormatError(bad.args[0], path, bad.args[1]) from None
        except RecursionError:
            raise SequenceFormatError("JSON nested too deeply", path) from None
        return cls._from_members(obj, path)

    @classmethod
    def from_dict(cls, obj, path=None) -> "FunctionSequence":
        """The sequence of a dict such as :meth:`to_dict` returns; SequenceFormatError where it
        is not one."""
        if isinstance(obj, dict):
            obj = dict(obj)
            for key, convert in (("variables", _variable), ("functions", _function)):
                records = obj.get(key)
                if isinstance(records, list):
                    try:
                        obj[key] = [convert(rec, i) for i, rec in enumerate(records)]
                    except _RecordError as bad:
                        obj[key] = bad
        return cls._from_members(obj, path)

    @classmethod
    def _from_members(cls, obj, path):
        """The sequence of a file's top-level object whose records are converted already (or
        the _RecordError of the first refused)."""
        def fail(msg, record=None):
            raise SequenceFormatError(msg, path, record)

        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            fail(f"not a function sequence (expected \"format\": \"{FORMAT}\")")
        if obj.get("version") != VERSION:
            fail(f"version {obj.get('version')!r} is not supported (this vmalloc reads {VERSION})")
        batch = obj.get("batch")
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                                  or batch < 1):
            fail(f"batch must be a positive int or null, got {batch!r}")
        meta = obj.get("meta") or {}
        if not isinstance(meta, dict):
            fail("meta must be an object")
        seq = cls(str(obj.get("name", "")), batch, meta)
        variables = obj.get("variables")
        functions = obj.get("functions")
        for records in (variables, functions):
            if isinstance(records, Exception):
                raise SequenceFormatError(records.args[0], path, records.args[1])
        if not isinstance(variables, list) or not isinstance(functions, list):
            fail("variables and functions must be lists")
        seq.variables = variables
        nvar = len(variables)
        for f in functions:
            if any(v >= nvar for v in f.inputs) or any(v >= nvar for v in f.outputs):
                fail(_FUNCTION_SHAPE.format(nvar=nvar, rec=str(
                    [f.name, list(f.inputs), list(f.outputs)])[:80]), f"functions[{f.index}]")
        seq.functions = functions
        return seq


class _RecordError(ValueError):
    """A record refused: args (message, record)."""


_FUNCTION_SHAPE = ("expected [name, [input ids], [output ids], flops|null, per_sample_flops, "
                   "seconds|null] with ids below {nvar}, got {rec}")


def _variable(rec, i):
    if (not isinstance(rec, list) or len(rec) != 4 or not _is_size(rec[0])
            or not _is_size(rec[1]) or rec[2] not in (0, 1)
            or not isinstance(rec[3], str)):
        raise _RecordError("expected [nbytes, per_sample_bytes, persistent 0|1, name] with "
                           f"sizes 0..2**56, got {str(rec)[:80]}", f"variables[{i}]")
    return Variable(i, rec[0], bool(rec[2]), rec[3], rec[1])


def _function(rec, i):
    """A Function of a record; its ids are checked against the variables by the caller (the
    file may list the functions first)."""
    if (not isinstance(rec, list) or len(rec) != 6 or not isinstance(rec[0], str)
            or not _is_ids(rec[1]) or not _is_ids(rec[2])
            or not _is_cost(rec[3]) or not _is_cost(rec[4], allow_none=False)
            or not _is_cost(rec[5])):
        raise _RecordError(_FUNCTION_SHAPE.format(nvar="the number of variables", rec=str(rec)[:80]),
                           f"functions[{i}]")
    for what, value, bound in (("flops", rec[3], MAX_FUNCTION_FLOPS),
                               ("per_sample_flops", rec[4], MAX_FUNCTION_FLOPS),
                               ("seconds", rec[5], MAX_FUNCTION_SECONDS)):
        if value is not None and float(value) > bound:
            raise _RecordError(f"{what} {value!r} is above the most a function may give "
                               f"({bound:g})", f"functions[{i}]")
    return Function(i, rec[0], tuple(rec[1]), tuple(rec[2]),
                    None if rec[3] is None else float(rec[3]),
                    None if rec[5] is None else float(rec[5]), float(rec[4]))


def _is_size(x):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_SIZE


def _is_ids(x):
    return isinstance(x, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v for v in x)


def _is_cost(x, allow_none=True):
    if x is None:
        return allow_none
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:  # an int past a double's range (10**400) is refused, not an OverflowError
        return 0 <= float(x) < float("inf")
    except OverflowError:
        return False
