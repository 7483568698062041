"""Hostile and huge inputs: every allocator refuses what it can never do in bounded time and
memory at once, every reader refuses a file that would fill memory, and the command line says
so in one line (exit 2). Each example finishes in well under a second."""

import gzip
import json
import os
import pickle
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.cli import main
from vmalloc.traces import EVENT_DTYPE, VmtraceWriter, open_trace
from vmalloc.traces.vmtrace import BLOCK_HEADER, BLOCK_MAGIC

FAST = settings(max_examples=60, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
ALLOCATORS = ["caching", "virtual", "virtual-packed", "logging"]


def _allocator(kind, device, tmp_path):
    if kind == "caching":
        return vmalloc.CachingAllocator(device)
    if kind == "virtual":
        return vmalloc.VirtualAllocator(device)
    if kind == "virtual-packed":
        return vmalloc.VirtualAllocator(device, placement="packed")
    return vmalloc.LoggingAllocator(vmalloc.VirtualAllocator(device), tmp_path / "log.vmtrace")


@pytest.mark.parametrize("kind", ["virtual", "virtual-packed"])
def test_virtual_refuses_2_46_at_once(kind, tmp_path):
    # Was 12 s and a bare MemoryError: 2**25 chunks of bookkeeping on an unlimited device.
    allocator = _allocator(kind, vmalloc.HostDevice(backed=False), tmp_path)
    start = time.perf_counter()
    with pytest.raises(vmalloc.OutOfMemoryError) as caught:
        allocator.allocate(2**46)
    assert time.perf_counter() - start < 0.5
    assert caught.value.requested_bytes == 2**46
    assert allocator.stats().reserved_bytes == 0
    # Nothing was changed: a normal request still works.
    p = allocator.allocate(1 << 20)
    allocator.deallocate(p, 1 << 20)


@pytest.mark.parametrize("kind", ["virtual", "virtual-packed"])
def test_one_chunk_past_the_pool_limit_is_refused_at_once(kind, tmp_path):
    # A pool keeps books for at most 2**20 chunks (2 TiB of 2 MiB chunks): one more is refused
    # before anything is built.
    allocator = _allocator(kind, vmalloc.HostDevice(backed=False), tmp_path)
    start = time.perf_counter()
    with pytest.raises(vmalloc.OutOfMemoryError):
        allocator.allocate((1 << 41) + (2 << 20))
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("kind", ALLOCATORS)
def test_over_the_request_limit_is_invalid(kind, tmp_path):
    allocator = _allocator(kind, vmalloc.HostDevice(backed=False), tmp_path)
    with pytest.raises(vmalloc.InvalidArgumentError):
        allocator.allocate((1 << 56) + 1)


@pytest.mark.parametrize("kind", ALLOCATORS)
def test_huge_sizes_fail_fast_or_succeed(kind, tmp_path):
    @FAST
    @given(size=st.integers(min_value=1 << 42, max_value=(1 << 64) - 1),
           capacity=st.sampled_from([None, 1 << 30, 80 << 30]))
    # One mapping of 2^56 bytes: set_access once sized its update list by granules (2^35
    # entries, a MemoryError) instead of by the mappings there are.
    @example(size=1 << 56, capacity=None)
    def run(size, capacity):
        options = {"backed": False}
        if capacity:
            options["capacity"] = capacity
        allocator = _allocator(kind, vmalloc.HostDevice(**options), tmp_path)
        start = time.perf_counter()
        try:
            p = allocator.allocate(size)
        except vmalloc.InvalidArgumentError:
            assert size > 1 << 56
        except vmalloc.OutOfMemoryError:
            assert allocator.stats().reserved_bytes == 0
        else:
            # Only the caching allocator holds a huge request in O(1) books, and only on an
            # unlimited device.
            assert kind == "caching" and capacity is None and size <= 1 << 56
            allocator.deallocate(p, size)
        assert time.perf_counter() - start < 0.5

    run()


@pytest.mark.parametrize("kind", ALLOCATORS)
def test_more_than_capacity_is_refused_at_once(kind, tmp_path):
    allocator = _allocator(kind, vmalloc.HostDevice(backed=False, capacity=1 << 30), tmp_path)
    start = time.perf_counter()
    with pytest.raises(vmalloc.OutOfMemoryError):
        allocator.allocate(1 << 40)
    assert time.perf_counter() - start < 0.5


# -- readers -----------------------------------------------------------------------------------


def _gzip_of_zeros(path, nbytes):
    block = bytes(1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(nbytes >> 20):
            f.write(block)


def test_gzip_bomb_named_pickle_is_refused_quickly(tmp_path):
    path = tmp_path / "bomb.pickle.gz"
    _gzip_of_zeros(path, 256 << 20)  # 256 KiB on disk
    for fmt in (None, "torch_snapshot"):
        start = time.perf_counter()
        with pytest.raises(vmalloc.TraceFormatError):
            open_trace(path, format=fmt).scan()
        assert time.perf_counter() - start < 0.5


def test_pickle_announcing_a_huge_string_is_refused_before_reading(tmp_path):
    # BINUNICODE8 of 2**40 bytes: the unpickler would ask for the whole string in one read.
    path = tmp_path / "huge.pickle"
    path.write_bytes(b"\x80\x04" + b"\x8d" + struct.pack("<Q", 1 << 40) + b"x" * 100)
    start = time.perf_counter()
    with pytest.raises(vmalloc.TraceFormatError, match="limit"):
        open_trace(path).scan()
    assert time.perf_counter() - start < 0.5


def test_snapshot_limit_is_enforced(tmp_path, monkeypatch):
    from vmalloc.traces import torch_snapshot

    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 16,
                                                       "size": 8, "stream": 0}] * 200]},
                                  protocol=4))
    open_trace(path).scan()
    monkeypatch.setattr(torch_snapshot, "MAX_SNAPSHOT_BYTES", 64)
    with pytest.raises(vmalloc.TraceFormatError, match="limit of 64 bytes"):
        open_trace(path).scan()


def test_rmm_csv_of_dev_zero_is_refused_fast():
    start = time.perf_counter()
    with pytest.raises(vmalloc.TraceFormatError, match="line 1 is longer"):
        open_trace("/dev/zero", format="rmm_csv").scan()
    assert time.perf_counter() - start < 0.5


def test_rmm_csv_long_record_is_a_format_error(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                    "1,0,allocate,0x10," + "1" * (2 << 20) + ",0x0\n")
    with pytest.raises(vmalloc.TraceFormatError) as caught:
        open_trace(path).scan()
    assert caught.value.record == 2


def test_kineto_huge_event_is_a_format_error(tmp_path):
    path = tmp_path / "k.json"
    path.write_text('{"traceEvents": [{"name": "' + "x" * (20 << 20) + '"}]}')
    start = time.perf_counter()
    with pytest.raises(vmalloc.TraceFormatError):
        open_trace(path).scan()
    assert time.perf_counter() - start < 2


def test_vmtrace_block_claiming_gigabytes_is_refused(tmp_path):
    path = tmp_path / "t.vmtrace"
    with VmtraceWriter(path, consistent=True) as w:
        w.write(np.zeros(0, dtype=EVENT_DTYPE))
    with open(path, "ab") as f:
        f.write(BLOCK_HEADER.pack(BLOCK_MAGIC, 10, 0xFFFFFFF0))
    with pytest.raises(vmalloc.TraceFormatError, match="compressed size"):
        open_trace(path).scan()


@settings(max_examples=40, deadline=1000)
@given(nbytes=st.integers(min_value=(1 << 41) + (2 << 20), max_value=(1 << 64) - 1),
       fmt=st.sampled_from(["kineto", "rmm_csv", "torch_snapshot"]))
def test_huge_sizes_in_every_format_replay_fast(tmp_path_factory, nbytes, fmt):
    from vmalloc.replay import replay

    d = tmp_path_factory.mktemp("huge")
    if fmt == "kineto":
        path = d / "t.json"
        path.write_text(json.dumps({"traceEvents": [{"ph": "i", "name": "[memory]", "args": {
            "Addr": 4096, "Bytes": nbytes, "Device Type": 1, "Device Id": 0}}]}))
    elif fmt == "rmm_csv":
        path = d / "t.csv"
        path.write_text(f"Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x1000,{nbytes},0x0\n")
    else:
        path = d / "t.pickle"
        path.write_bytes(pickle.dumps({"device_traces": [[
            {"action": "alloc", "addr": 4096, "size": nbytes, "stream": 0}]]}))
    start = time.perf_counter()
    if nbytes > 1 << 56:
        # Past vmalloc's request limit: the replay stops with one error naming the event.
        with pytest.raises(vmalloc.InvalidArgumentError, match="trace event 0 .*2\\*\\*56"):
            replay(str(path), max_probes=4)
        assert time.perf_counter() - start < 1
        return
    results = replay(str(path), max_probes=4)
    assert time.perf_counter() - start < 1
    for r in results:
        if r.allocator != "caching" or nbytes > 1 << 56:
            assert not r.completed and r.out_of_memory_event == 0
            assert r.utilization is None
            assert r.min_capacity_bytes is None


# -- the command line ------------------------------------------------------------------------


def _cli(*args):
    # The package under test, whichever build PYTHONPATH names, run away from the source tree.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(vmalloc.__file__)))
    return subprocess.run([sys.executable, "-m", "vmalloc", *args], capture_output=True,
                          text=True, timeout=60, cwd="/", env=env)  # not the source tree: the build


def test_cli_dev_zero_one_line_exit_2():
    start = time.perf_counter()
    done = _cli("replay", "--format", "rmm_csv", "/dev/zero")
    assert time.perf_counter() - start < 10
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "line 1 is longer" in done.stderr


def test_cli_gzip_bomb_one_line_exit_2(tmp_path):
    path = tmp_path / "bomb.pickle.gz"
    _gzip_of_zeros(path, 64 << 20)
    done = _cli("replay", "--format", "torch_snapshot", str(path))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_cli_one_event_of_2_48(tmp_path, capsys):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "i", "name": "[memory]", "args": {
        "Addr": 4096, "Bytes": 1 << 48, "Device Type": 1, "Device Id": 0}}]}))
    start = time.perf_counter()
    assert main(["replay", str(path), "--json"]) == 0
    assert time.perf_counter() - start < 2
    results = json.loads(capsys.readouterr().out)
    by = {r["allocator"]: r for r in results}
    assert by["caching"]["completed"] and by["caching"]["peak_reserved_bytes"] == 1 << 48
    for kind in ("virtual", "virtual-packed"):
        assert by[kind]["out_of_memory_event"] == 0
        assert by[kind]["out_of_memory_request_bytes"] == 1 << 48
        assert by[kind]["utilization"] is None
        assert by[kind]["min_capacity_bytes"] is None


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


def _peak_rss_mib(code, *args):
    """Runs ``code`` in a fresh interpreter; its peak resident memory in MiB."""
    script = code + "\n" + _PEAK
    out = subprocess.run([sys.executable, "-P", "-c", script, *args], check=True,
                         capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(
                             os.path.dirname(vmalloc.__file__)))).stdout
    return int(out.split()[-1])


def test_snapshot_of_shared_device_lists_reads_in_bounded_memory(tmp_path):
    # A 3 KB pickle whose 300 devices are memo references to one list of 1,000 references to
    # two dicts: 300,000 history entries decoded. Each device's reader used to unpickle the
    # file again and copy the list's rows once per reference (1.5 GB for the 300 readers; the
    # 1,000-device file took 1.2-9 GB and ended in "not a PyTorch memory snapshot: reading it
    # runs out of memory"): the readers now share one reading, whose rows are shared with the
    # list. Generous bound: about 45 MiB measured, the interpreter and NumPy included.
    alloc = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0}
    free = {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0}
    history = [alloc, free] * 500
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [history] * 300, "segments": []}, 4))
    assert path.stat().st_size < 4096
    peak = _peak_rss_mib(
        "import sys\nfrom vmalloc.traces import open_trace, trace_devices\n"
        "counts = trace_devices(sys.argv[1])\n"
        "assert counts == {f'cuda:{i}': 1000 for i in range(300)}, counts\n"
        "traces = [open_trace(sys.argv[1], device=d) for d in counts]\n"
        "events = [sum(len(b) for b in t.batches()) for t in traces]\n"
        "assert events == [1000] * 300, events", str(path))
    assert peak < 300, f"{peak} MiB"


def test_running_out_of_memory_is_not_called_a_bad_snapshot(tmp_path, monkeypatch):
    # Was TraceFormatError("not a PyTorch memory snapshot: reading it runs out of memory").
    from vmalloc.traces import _fast, torch_snapshot

    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[]]}))

    class Exhausted:
        def __init__(self, *args):
            raise MemoryError

    if _fast._trace_parse is not None:
        monkeypatch.setattr(_fast._trace_parse, "Snapshot", Exhausted)
        with pytest.raises(vmalloc.OutOfMemoryError, match="needs more memory") as info:
            _fast.snapshot(path, torch_snapshot.MAX_SNAPSHOT_BYTES)
        assert "not a PyTorch memory snapshot" not in str(info.value)
    # Python's unpickler: a MemoryError may also come of a corrupt length field; either way
    # the message says memory, not "not a PyTorch memory snapshot".
    monkeypatch.setattr(torch_snapshot, "_NoClassesUnpickler", Exhausted)
    with pytest.raises(vmalloc.TraceFormatError, match="more memory than this machine") as info:
        torch_snapshot.load_snapshot(path)
    assert "not a PyTorch memory snapshot" not in str(info.value)
