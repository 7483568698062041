"""One byte formatter: :func:`vmalloc.format_size` on the Python side and
``vmalloc::detail::human_bytes`` on the C++ side write every size alike, and nothing else in
the package formats bytes its own way (issue 17: there were five: a second one in the
caching allocator, one in the driver emulator, GiB figures in the replay plot, and the two
kept apart wrote "2.00MiB" and "2.00 MiB")."""

import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc._core.device import _human_bytes
from vmalloc.sizes import binary_unit, format_size

ROOT = pathlib.Path(__file__).resolve().parents[2]
KiB, MiB, GiB, TiB, PiB = (1 << 10), (1 << 20), (1 << 30), (1 << 40), (1 << 50)


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (KiB * 1023 + 1023, "1024.00 KiB"),  # 1023.999 KiB rounds in its own unit
    (2 * MiB, "2.00 MiB"), (5 * MiB + 1, "5.00 MiB"), (int(1.25 * GiB), "1.25 GiB"),
    (3 * TiB, "3.00 TiB"), (PiB, "1.00 PiB"), (1 << 56, "64.00 PiB"),
    (1 << 62, "4096.00 PiB"),  # no unit above PiB
])
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text
    assert vmalloc.format_size is format_size


def test_exact_adds_the_count_where_the_unit_rounds():
    assert format_size(2 * MiB, exact=True) == "2.00 MiB (2097152 bytes)"
    assert format_size(1536, exact=True) == "1.50 KiB (1536 bytes)"
    assert format_size(512, exact=True) == "512 B"


def test_negative_sizes_keep_their_sign():
    # Differences (reserved memory saved, a shrink) are sizes too.
    assert format_size(-2048) == "-2.00 KiB"
    assert format_size(-5) == "-5 B"


def test_binary_unit_is_the_unit_format_size_writes():
    assert binary_unit(0) == ("B", 1)
    assert binary_unit(1023) == ("B", 1)
    assert binary_unit(1024) == ("KiB", KiB)
    assert binary_unit(3 * GiB) == ("GiB", GiB)
    assert binary_unit(-3 * GiB) == ("GiB", GiB)
    assert binary_unit(1 << 62) == ("PiB", PiB)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.integers(0, (1 << 64) - 1), st.integers(0, 64).map(lambda k: (1 << k) - 1),
                 st.integers(0, 64).map(lambda k: 1 << k if k < 64 else (1 << 64) - 1)),
       st.booleans())
def test_the_cpp_formatter_writes_the_same(nbytes, exact):
    assert _human_bytes(nbytes, exact) == format_size(nbytes, exact=exact)
    unit, scale = binary_unit(nbytes)
    assert format_size(nbytes).endswith(" " + unit)
    assert scale == 1 or nbytes >= scale


def test_the_library_messages_use_it():
    device = vmalloc.HostDevice(capacity="8MiB", backed=False)
    allocator = vmalloc.VirtualAllocator(device)
    p = allocator.allocate(3 * MiB)
    assert f"requested={format_size(3 * MiB)} (peak {format_size(3 * MiB)})" in repr(allocator)
    allocator.deallocate(p, 3 * MiB)
    caching = vmalloc.CachingAllocator(vmalloc.HostDevice(capacity="40MiB", backed=False))
    with pytest.raises(vmalloc.OutOfMemoryError) as info:
        caching.allocate(50 * MiB)
    assert f"allocating {format_size(50 * MiB, exact=True)}" in str(info.value)
    with pytest.raises(vmalloc.InvalidArgumentError) as info:
        vmalloc.CachingAllocator(vmalloc.HostDevice(backed=False), max_split_size=MiB)
    assert f"max_split_size {format_size(MiB, exact=True)} is below" in str(info.value)


# Formatting bytes by hand: a unit after an f-string field ("{x / GiB:.2f} GiB") or a printf
# conversion ("%.2f MiB"), or a table of the binary units.
_PY_BY_HAND = re.compile(r"\}\s?(KiB|MiB|GiB|TiB|PiB)\b|[\"']KiB[\"'],\s*[\"']MiB[\"']")
_CPP_BY_HAND = re.compile(r"%[.0-9]*[fgd]\s?(KiB|MiB|GiB|TiB)\b|\"KiB\",\s*\"MiB\"")


def by_hand(root=ROOT):
    """'file:line' of each byte formatting outside the two formatters."""
    found = []
    sources = [(p, _PY_BY_HAND) for p in sorted((root / "vmalloc").rglob("*.py"))
               + sorted((root / "vmalloc").rglob("*.pyx"))]
    sources += [(p, _CPP_BY_HAND) for p in sorted((root / "src").rglob("*.cpp"))
                + sorted((root / "src").rglob("*.hpp")) + sorted((root / "include").rglob("*.hpp"))]
    home = {root / "vmalloc" / "sizes.py", root / "src" / "base" / "format.cpp"}
    for path, pattern in sources:
        if path in home:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_nothing_else_formats_bytes():
    assert by_hand() == []


def test_the_scan_finds_formatting_by_hand(tmp_path):
    (tmp_path / "vmalloc").mkdir()
    (tmp_path / "src" / "alloc").mkdir(parents=True)
    (tmp_path / "include").mkdir()
    (tmp_path / "vmalloc" / "plot.py").write_text(
        'label = f"peak {peak / GiB:.2f} GiB"\nok = "2MiB"\n')
    (tmp_path / "src" / "alloc" / "a.cpp").write_text(
        'std::snprintf(buf, sizeof buf, "%zu bytes (%.2f MiB)", n, mib);\n'
        'const char* units[] = {"B", "KiB", "MiB"};\n')
    assert by_hand(tmp_path) == ["vmalloc/plot.py:1", "src/alloc/a.cpp:1", "src/alloc/a.cpp:2"]
