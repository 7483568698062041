"""The function-sequence loader's bounds (vmalloc/offload/sequence/_sequence_file.py): numbers
past a double's range, non-regular files and memory bounded by the decoded content; and the same
answers as decoding the whole JSON (``FunctionSequence.from_dict(json.loads(...))``) on random
files, valid or not."""

import gzip
import json
import os
import subprocess
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.offload import FunctionSequence, SequenceFormatError
from vmalloc.offload.sequence import sequence as sequence_module

HEAD = {"format": "vmalloc-function-sequence", "version": 1, "name": "x", "batch": None,
        "meta": {}}


def _write(tmp_path, obj, name="s.json"):
    path = tmp_path / name
    data = json.dumps(obj).encode() if not isinstance(obj, (bytes, str)) else obj
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("cost", ["1" + "0" * 400, "-" + "1" * 400, "1e400"],
                         ids=["10**400", "-1...1", "1e400"])
@pytest.mark.parametrize("field", [3, 4, 5])
def test_huge_numbers_are_format_errors(tmp_path, cost, field):
    # Was an OverflowError traceback (float(10**400)).
    record = ['"f"', "[0]", "[0]", "0", "0", "0"]
    record[field] = cost
    text = ('{"format": "vmalloc-function-sequence", "version": 1, "variables": [[8, 0, 0, "a"]],'
            ' "functions": [[' + ", ".join(record) + "]]}")
    path = _write(tmp_path, text)
    with pytest.raises(SequenceFormatError, match=r"functions\[0\]") as info:
        FunctionSequence.load(path)
    assert info.value.record == "functions[0]"
    with pytest.raises(SequenceFormatError):
        FunctionSequence.from_dict(json.loads(text))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    # Was a hang: open() of a FIFO waits for a writer.
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    result = {}

    def load():
        try:
            FunctionSequence.load(path)
        except SequenceFormatError as error:
            result["error"] = str(error)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # unblock it before failing
        with open(path, "wb"):
            pass
        pytest.fail("loading a FIFO blocked")
    assert "not a regular file (a FIFO)" in result["error"]
    with pytest.raises(SequenceFormatError, match="not a regular file"):
        FunctionSequence.load(tmp_path)


#: Prints the peak resident memory of this process in MiB: the high-water mark of its own
#: address space (VmHWM), which exec resets; ru_maxrss keeps the forking parent's (a test
#: process that imported PyTorch) across exec.
_PEAK = """
import resource
try:
    with open("/proc/self/status") as status:
        print(next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) // 1024)
except OSError:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def _peak_mib(path):
    script = ("import resource, sys\nfrom vmalloc.offload import FunctionSequence, "
              "SequenceFormatError\ntry:\n    FunctionSequence.load(sys.argv[1])\n"
              "except SequenceFormatError as e:\n    print(e)\n" + _PEAK)
    # The vmalloc under test, whatever an earlier test did to the environment.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(vmalloc.__file__)))
    out = subprocess.run([sys.executable, "-P", "-c", script, str(path)], check=True,
                         capture_output=True, text=True, env=env).stdout
    return int(out.split()[-1]), out


def test_memory_is_bounded_by_the_decoded_content(tmp_path):
    # A 12 KB gzip of 6 MB of JSON whose bulk (2 M empty lists) is a member the format does
    # not read, and one whose functions are 2 M empty lists: json.loads built a list object
    # for each (about 170 MiB); the loader skips the one and refuses the other at its first
    # record. Generous bound: about 60 MiB measured, the interpreter included.
    junk = ",".join(["[]"] * 2_000_000)
    head = json.dumps(HEAD)[:-1]
    for body in (f', "junk": [{junk}], "variables": [], "functions": []}}',
                 f', "variables": [], "functions": [{junk}]}}'):
        path = tmp_path / "bomb.json.gz"
        path.write_bytes(gzip.compress((head + body).encode()))
        assert path.stat().st_size < 16_000
        peak, out = _peak_mib(path)
        assert peak < 120, (peak, out)
    assert "functions[0]: expected [name" in out


def test_text_past_the_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sequence_module, "MAX_FILE_BYTES", 1000)
    path = tmp_path / "big.json.gz"
    path.write_bytes(gzip.compress(b" " * 5000 + json.dumps(HEAD).encode()))
    with pytest.raises(SequenceFormatError, match="larger than 1,000 bytes decompressed"):
        FunctionSequence.load(path)


def test_functions_before_variables_and_empty(tmp_path):
    text = ('{"functions": [["f", [1], [0], null, 0, 2.5]], "variables": [[8, 1, 0, "a"], '
            '[16, 0, 1, "b"]], "version": 1, "format": "vmalloc-function-sequence", '
            '"junk": {"a": [1, {"b": "]"}]}, "batch": null}')
    seq = FunctionSequence.load(_write(tmp_path, text))
    assert [f.inputs for f in seq.functions] == [(1,)] and seq.functions[0].seconds == 2.5
    assert seq.variables[1].persistent and seq.batch is None
    empty = dict(HEAD, variables=[], functions=[])
    seq = FunctionSequence.load(_write(tmp_path, empty))
    assert len(seq) == 0 and seq.batch is None


# Random files: the loader and json.loads + from_dict agree (the same sequence, or both refuse).

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**57),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4))
_records = st.lists(st.one_of(_scalars, st.lists(st.integers(-1, 4), max_size=3),
                              st.lists(_scalars, max_size=2)), max_size=7)
_variables = st.lists(st.one_of(
    st.tuples(st.integers(0, 2**20), st.integers(0, 9), st.sampled_from([0, 1]),
              st.text(max_size=3)).map(list), _records), max_size=4)
_functions = st.lists(st.one_of(
    st.tuples(st.text(max_size=3), st.lists(st.integers(0, 4), max_size=3),
              st.lists(st.integers(0, 4), max_size=3), st.one_of(st.none(), st.floats(0, 1e9)),
              st.floats(0, 10), st.one_of(st.none(), st.integers(0, 10))).map(list),
    _records), max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(variables=_variables, functions=_functions, extra=st.dictionaries(
    st.sampled_from(["batch", "meta", "name", "junk"]),
    st.one_of(_scalars, _records, st.dictionaries(st.text(max_size=2), _scalars, max_size=2)),
    max_size=2), indent=st.sampled_from([None, 1]))
def test_same_as_decoding_the_whole_json(tmp_path, variables, functions, extra, indent):
    obj = dict(HEAD, variables=variables, functions=functions, **extra)
    text = json.dumps(obj, indent=indent)
    path = _write(tmp_path, text)
    try:
        expected = FunctionSequence.from_dict(json.loads(text))
    except SequenceFormatError as error:
        with pytest.raises(SequenceFormatError) as info:
            FunctionSequence.load(path)
        assert info.value.record == error.record
        return
    got = FunctionSequence.load(path)
    assert got.to_dict() == expected.to_dict()


# --- issue 20 ("Also"): tiny records, long records and huge costs are refused at once ---------

def test_records_past_the_value_bound_are_refused_before_they_are_decoded(tmp_path,
                                                                          monkeypatch):
    # A 204 KB gzip of 20 million `[0,0,0,""]` records raised MemoryError (gigabytes of
    # Python objects): the values are counted off each batch before it is decoded.
    decoded = []
    real = sequence_module._variable
    monkeypatch.setattr(sequence_module, "_variable",
                        lambda rec, i: decoded.append(i) or real(rec, i))
    monkeypatch.setattr(sequence_module, "MAX_RECORD_VALUES", 1000)
    records = ",".join(['[0,0,0,""]'] * 5000)
    path = tmp_path / "tiny.json.gz"
    path.write_bytes(gzip.compress((json.dumps(HEAD)[:-1] + f', "variables": [{records}], '
                                    '"functions": []}').encode()))
    with pytest.raises(SequenceFormatError) as info:
        FunctionSequence.load(path)
    assert str(info.value) == (f"{path}: its records hold more than 1,000 values (numbers, "
                               "strings and ids); refused (the loader's bound, "
                               "MAX_RECORD_VALUES)")
    assert decoded == []   # refused before its first batch of 1,024 records was decoded


def test_records_within_the_value_bound_load(tmp_path, monkeypatch):
    monkeypatch.setattr(sequence_module, "MAX_RECORD_VALUES", 1000)
    records = ",".join(['[8,0,0,"v"]'] * 200)   # 800 values (4 per record, their commas)
    path = _write(tmp_path, json.dumps(HEAD)[:-1] + f', "variables": [{records}], '
                  '"functions": [["f", [0], [1], null, 0, null]]}')
    seq = FunctionSequence.load(path)
    assert (len(seq.variables), len(seq.functions)) == (200, 1)


def test_a_record_past_the_length_bound_is_refused_without_reading_the_rest(tmp_path,
                                                                             monkeypatch):
    # One function of 120 million ids (a 233 KB gzip) raised MemoryError in the regular
    # expression's backtracking stack.
    from vmalloc.offload.sequence import _sequence_file

    monkeypatch.setattr(_sequence_file, "MAX_RECORD_CHARS", 1000)
    skipped = []
    real_skip = _sequence_file._skip
    monkeypatch.setattr(_sequence_file, "_skip",
                        lambda text, pos, endpos=None: skipped.append(
                            (endpos or len(text)) - pos) or real_skip(text, pos, endpos))
    ids = ",".join(["0"] * 100_000)
    path = _write(tmp_path, json.dumps(HEAD)[:-1] + ', "variables": [[8, 0, 0, "a"]], '
                  f'"functions": [["f", [{ids}], [], null, 0, null]]}}')
    with pytest.raises(SequenceFormatError) as info:
        FunctionSequence.load(path)
    assert info.value.record == "functions[0]"
    assert str(info.value) == (f"{path}: functions[0]: a record of more than 1,000 bytes of "
                               "JSON, the most the loader reads; refused")
    # the record is looked at up to the bound only, and the array is not skipped after it
    assert skipped[-1] == 1000


@pytest.mark.parametrize("field, name, value, bound", [
    (5, "seconds", 1e308, "1e+06"), (3, "flops", 1e300, "1e+24"),
    (4, "per_sample_flops", 1e25, "1e+24")])
def test_a_cost_past_the_bound_is_refused(tmp_path, field, name, value, bound):
    # A function of 1e308 seconds made `vmalloc offload simulate` end in an OverflowError
    # traceback (intermediate overflow in fsum).
    record = ["f", [0], [0], None, 0, None]
    record[field] = value
    obj = dict(HEAD, variables=[[8, 0, 0, "a"]], functions=[record])
    path = _write(tmp_path, obj)
    message = f"functions[0]: {name} {value!r} is above the most a function may give ({bound})"
    with pytest.raises(SequenceFormatError) as info:
        FunctionSequence.load(path)
    assert str(info.value) == f"{path}: {message}"
    with pytest.raises(SequenceFormatError) as info:
        FunctionSequence.from_dict(obj)
    assert str(info.value) == message
    seq = FunctionSequence("x")
    seq.add_variable(8)
    with pytest.raises(vmalloc.InvalidArgumentError) as info:
        seq.add_function([0], [0], **{name: value})
    assert str(info.value) == f"{name} must be at most {bound}, got {value!r}"


def test_tiny_records_past_the_default_bound_are_refused_in_bounded_memory(tmp_path):
    # The default bound, no patching: 600,000 `[0,0,0,""]` records (2.4 M values) in a gzip
    # of a few KB; loading them took over 100 MiB of Python objects (20 M: MemoryError).
    n = 600_000
    path = tmp_path / "tiny.json.gz"
    path.write_bytes(gzip.compress((json.dumps(HEAD)[:-1] + ', "variables": ['
                                    + ",".join(['[0,0,0,""]'] * n) + '], "functions": []}'
                                    ).encode()))
    assert path.stat().st_size < 50_000
    peak, out = _peak_mib(path)
    assert "its records hold more than 2,097,152 values" in out
    assert peak < 200, (peak, out)
