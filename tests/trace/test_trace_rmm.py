"""The RMM logging CSV reader: RMM's columns and pointer syntax, skipped failures, and errors
that name the line."""

import pytest

import vmalloc
from vmalloc.traces import ALLOC, FREE, open_trace

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def write_log(path, body, header=HEADER):
    path.write_text(header + body)
    return path


def as_tuples(batch):
    return [(int(x["op"]), int(x["stream"]), int(x["addr"]), int(x["size"])) for x in batch]


def test_rmm_log(tmp_path):
    path = write_log(
        tmp_path / "rmm_log.csv",
        "140573312345856,14:03:22.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020\n"
        "140573312345856,14:03:22.123460,allocate,0x7f8a40000400,2048,0\n"
        "140573312345857,14:03:22.123470,allocate failure,(nil),1099511627776,0\n"
        "140573312345856,14:03:22.123480,free,0x7f8a40000000,1024,0x7f8a38001020\n"
        "\n"
        "140573312345856,14:03:22.123490,free,0x7f8a40000400,2048,0\n",
    )
    trace = open_trace(path)
    assert trace.format == "rmm_csv"
    assert as_tuples(trace.events()) == [
        (ALLOC, 0x7F8A38001020, 0x7F8A40000000, 1024),
        (ALLOC, 0, 0x7F8A40000400, 2048),
        (FREE, 0x7F8A38001020, 0x7F8A40000000, 1024),
        (FREE, 0, 0x7F8A40000400, 2048),
    ]
    info = trace.info
    assert info.skipped == {"allocate failure": 1}
    assert (info.allocs, info.frees, info.streams) == (2, 2, 2)
    assert info.peak_live_bytes == 3072
    # The extra scan of before_window="live" does not count skipped records twice.
    assert open_trace(path, before_window="live").scan().skipped == {"allocate failure": 1}


def test_columns_by_name_and_without_stream(tmp_path):
    path = write_log(
        tmp_path / "log.txt",
        "allocate,7f00,16,5\nfree,0X7F00,16,5\n",
        header="Action,Pointer,Size,Thread\n",
    )
    assert as_tuples(open_trace(path).events()) == [(ALLOC, 0, 0x7F00, 16), (FREE, 0, 0x7F00, 16)]


def test_inconsistencies_are_normalized_and_counted(tmp_path):
    path = write_log(
        tmp_path / "log.csv",
        "1,t,free,0x500,64,0\n"  # allocated before logging began
        "1,t,allocate,0x100,32,0\n"
        "1,t,allocate,0x100,48,0\n"  # the log lost the free of the first 0x100
        "1,t,free,0x100,40,0\n"  # a size other than the allocation's: the allocation's wins
        "1,t,allocate,0x200,0,0\n"  # zero-size: nothing to replay
        "1,t,free,(nil),0,0\n",
    )
    trace = open_trace(path)
    assert as_tuples(trace.events()) == [
        (ALLOC, 0, 0x100, 32),
        (FREE, 0, 0x100, 32),
        (ALLOC, 0, 0x100, 48),
        (FREE, 0, 0x100, 48),
    ]
    info = trace.info
    assert (info.unmatched_frees, info.unmatched_free_bytes) == (1, 64)
    assert info.implicit_frees == 1
    assert info.free_size_mismatches == 1
    assert info.skipped == {"zero-size alloc": 1, "free of address 0": 1}

    live = open_trace(path, before_window="live")
    assert as_tuples(live.events())[:2] == [(ALLOC, 0, 0x500, 64), (FREE, 0, 0x500, 64)]
    assert (live.info.synthetic_allocs, live.info.unmatched_frees) == (1, 0)


@pytest.mark.parametrize(
    "body, line, message",
    [
        ("1,t,allocate,0x10,16,0\n1,t,explode,0x10,16,0\n", 3, "unknown action 'explode'"),
        ("1,t,allocate,zz,16,0\n", 2, "Pointer must be a hexadecimal address"),
        ("1,t,allocate,0x10,-16,0\n", 2, "Size must be a non-negative integer"),
        ("1,t,allocate,0x10,16,0\n1,t,allocate\n", 3, "3 columns, expected 6"),
        ("1,t,allocate,0x10,16,0\n1,t,free,0x10,16,0xg\n", 3, "Stream must be a hexadecimal"),
        ('1,t,"allocate,0x10,16,0\n', 2, "malformed CSV"),
    ],
)
def test_errors_name_the_line(tmp_path, body, line, message):
    path = write_log(tmp_path / "log.csv", body)
    with pytest.raises(vmalloc.TraceFormatError, match=message) as error:
        open_trace(path).scan()
    assert error.value.record == line
    assert error.value.path == str(path)


def test_not_an_rmm_log(tmp_path):
    path = write_log(tmp_path / "x.csv", "1,2,3\n", header="a,b,c\n")
    with pytest.raises(vmalloc.TraceFormatError, match="header lacks Action, Pointer, Size") as error:
        open_trace(path).scan()
    assert error.value.record == 1
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(vmalloc.TraceFormatError, match="empty file"):
        open_trace(empty).scan()


@pytest.mark.parametrize("python_readers", [False, True])
def test_double_free_is_called_a_double_free(tmp_path, monkeypatch, capsys, python_readers):
    # Was counted (and reported) as a free of memory the trace never allocated.
    from vmalloc.cli import main

    if python_readers:
        monkeypatch.setenv("VMALLOC_PYTHON_READERS", "1")
    path = write_log(
        tmp_path / "double.csv",
        "1,14:03:22.1,allocate,0x1000,1024,0\n"
        "1,14:03:22.2,free,0x1000,1024,0\n"
        "1,14:03:22.3,free,0x1000,1024,0\n"       # the double free
        "1,14:03:22.4,free,0x9000,512,0\n"        # never allocated
        "1,14:03:22.5,allocate,0x1000,256,0\n"
        "1,14:03:22.6,free,0x1000,256,0\n",       # a free again after a new allocation
    )
    trace = open_trace(path)
    assert as_tuples(trace.events()) == [
        (ALLOC, 0, 0x1000, 1024), (FREE, 0, 0x1000, 1024),
        (ALLOC, 0, 0x1000, 256), (FREE, 0, 0x1000, 256)]
    info = trace.info
    assert (info.double_frees, info.unmatched_frees, info.unmatched_free_bytes) == (1, 1, 512)
    assert main(["replay", str(path), "-a", "caching", "--no-min-capacity"]) == 0
    err = capsys.readouterr().err
    assert "double frees: 1 (frees of memory the trace had freed already" in err
    assert "frees of memory the trace never allocated: 1 (512 B)" in err
