"""The C++ tree's layering (docs/architecture.rst): base <- device <- chunks <- alloc <-
{trace, capi, offload, bench}. A file may include headers of its own layer and of the layers
below it, never of a layer above it nor of a sibling on the top tier. The driver emulator
(src/emulator/) is a device-layer program: it links only the device library."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Layer -> rank; the top tier's layers share a rank but may not include one another.
RANKS = {"base": 0, "device": 1, "chunks": 2, "alloc": 3,
         "trace": 4, "capi": 4, "offload": 4, "bench": 4}

_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](vmalloc/[^">]+)[">]')


def header_layer(name):
    """The layer of an include path "vmalloc/..." (None if it belongs to none)."""
    parts = name.split("/")
    if parts == ["vmalloc", "c_api.h"]:
        return "capi"
    if len(parts) >= 3 and parts[1] in RANKS:
        return parts[1]
    return None


def file_layer(root, path):
    """The layer of a file under include/ or src/ (None if it belongs to none)."""
    rel = path.relative_to(root).parts
    if rel[0] == "include":
        return header_layer("/".join(rel[1:]))
    if rel[0] == "src" and len(rel) >= 3:
        if rel[1] == "emulator":
            return "device"
        if rel[1] in RANKS:
            return rel[1]
    return None


def sources(root):
    for top in ("include", "src"):
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".h", ".hpp", ".cpp"):
                yield path


def violations(root):
    """'file:line: message' for every file outside the layers and every include that points up
    a layer (or sideways on the top tier)."""
    found = []
    for path in sources(root):
        rel = path.relative_to(root)
        layer = file_layer(root, path)
        if layer is None:
            found.append(f"{rel}:1: not in a layer folder ({', '.join(RANKS)})")
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = _INCLUDE.match(line)
            if not match:
                continue
            target = header_layer(match.group(1))
            if target is None:
                found.append(f"{rel}:{lineno}: includes {match.group(1)}, which is in no layer")
            elif target != layer and RANKS[target] >= RANKS[layer]:
                found.append(f"{rel}:{lineno}: {layer} includes {match.group(1)} ({target}, "
                             f"{'above' if RANKS[target] > RANKS[layer] else 'a sibling'})")
    return found


def test_no_include_points_up():
    found = violations(ROOT)
    assert not found, "includes against the layering:\n" + "\n".join(found)


def test_every_layer_has_files():
    layers = {file_layer(ROOT, path) for path in sources(ROOT)}
    assert set(RANKS) <= layers


def test_check_reports_an_upward_include(tmp_path):
    (tmp_path / "include/vmalloc/device").mkdir(parents=True)
    (tmp_path / "include/vmalloc/alloc").mkdir(parents=True)
    (tmp_path / "src/trace").mkdir(parents=True)
    (tmp_path / "src/offload").mkdir(parents=True)
    (tmp_path / "include/vmalloc/alloc/allocator.hpp").write_text(
        '#include "vmalloc/device/device.hpp"\n')
    (tmp_path / "include/vmalloc/device/device.hpp").write_text(
        '#pragma once\n#include <vector>\n#include "vmalloc/alloc/allocator.hpp"\n')
    (tmp_path / "src/trace/x.cpp").write_text('#include "vmalloc/offload/y.hpp"\n')
    (tmp_path / "src/offload/y.cpp").write_text('#include "vmalloc/trace/x.hpp"\n'
                                                '#include "vmalloc/c_api.h"\n')
    (tmp_path / "src/z.cpp").write_text("")
    assert violations(tmp_path) == [
        "include/vmalloc/device/device.hpp:3: device includes vmalloc/alloc/allocator.hpp "
        "(alloc, above)",
        "src/offload/y.cpp:1: offload includes vmalloc/trace/x.hpp (trace, a sibling)",
        "src/offload/y.cpp:2: offload includes vmalloc/c_api.h (capi, a sibling)",
        "src/trace/x.cpp:1: trace includes vmalloc/offload/y.hpp (offload, a sibling)",
        "src/z.cpp:1: not in a layer folder (base, device, chunks, alloc, trace, capi, "
        "offload, bench)",
    ]
