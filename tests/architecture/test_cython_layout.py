"""The Cython layer's layout: C++ is declared only in .pxd files under vmalloc/_lib/, one per
header, in folders that mirror include/vmalloc/<layer>/ (a file declares its header, and may
declare others of the same layer); a declaration file cimports only from its own layer and the
layers below (the rule tests/architecture/test_layering.py checks for the headers); the wrapper modules
(.pyx) declare no C++ themselves."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB = ROOT / "vmalloc" / "_lib"

_EXTERN = re.compile(r'^\s*cdef\s+extern\s+from\s+"([^"]+)"', re.M)
_CIMPORT = re.compile(r"^\s*(?:from\s+vmalloc\._lib\.([\w.]+)\s+cimport|cimport\s+vmalloc\._lib"
                      r"\.([\w.]+))", re.M)

#: Declaration files outside the mirror, and the one header each declares.
OUTSIDE = {"translate.pxd": "_core/translate.hpp", "c_api.pxd": "vmalloc/c_api.h",
           "dlfcn.pxd": "<dlfcn.h>"}


def _ranks():
    spec = importlib.util.spec_from_file_location("_layering", ROOT / "tests" / "architecture" / "test_layering.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RANKS, module.header_layer


def declaration_files(root=ROOT):
    return sorted(p for p in (root / "vmalloc" / "_lib").rglob("*.pxd")
                  if p.name != "__init__.pxd")


def problems(root=ROOT):
    """'file:line: message' for every break of the layout."""
    ranks, header_layer = _ranks()
    lib = root / "vmalloc" / "_lib"
    found = []
    for path in sorted((root / "vmalloc").rglob("*.pyx")):
        text = path.read_text(encoding="utf-8")
        for match in _EXTERN.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(root)}:{line}: declares C/C++ ({match.group(1)}); "
                         "declarations belong in a .pxd under vmalloc/_lib/")
    for path in declaration_files(root):
        rel = path.relative_to(lib)
        text = path.read_text(encoding="utf-8")
        externs = _EXTERN.findall(text)
        if str(rel) in OUTSIDE:
            expected, layer = OUTSIDE[str(rel)], None
        else:
            expected = "vmalloc/" + str(rel.with_suffix(".hpp"))
            layer = header_layer(expected)
            if not (root / "include" / expected).is_file():
                found.append(f"vmalloc/_lib/{rel}:1: mirrors no header (include/{expected})")
        if expected not in externs:
            found.append(f"vmalloc/_lib/{rel}:1: does not declare its header {expected}")
        for header in externs:
            # Another header of the same layer is allowed: a type that moves to a header of
            # its own (ChunkStats) stays declared where its users are.
            if header != expected and (layer is None or header_layer(header) != layer):
                found.append(f"vmalloc/_lib/{rel}:1: declares {header}, which is not a "
                             f"header of its layer ({layer or expected})")
        for match in _CIMPORT.finditer(text):
            module = match.group(1) or match.group(2)
            line = text.count("\n", 0, match.start()) + 1
            target = module.split(".")[0]
            if target + ".pxd" in OUTSIDE:
                continue  # translate, c_api, dlfcn: below every layer
            if layer is None:
                found.append(f"vmalloc/_lib/{rel}:{line}: cimports vmalloc._lib.{module}")
            elif target not in ranks:
                found.append(f"vmalloc/_lib/{rel}:{line}: cimports vmalloc._lib.{module}, "
                             "which is in no layer")
            elif target != layer and ranks[target] >= ranks[layer]:
                found.append(f"vmalloc/_lib/{rel}:{line}: {layer} cimports "
                             f"vmalloc._lib.{module} ({target}, "
                             f"{'above' if ranks[target] > ranks[layer] else 'a sibling'})")
    return found


def test_the_layout_holds():
    found = problems()
    assert not found, "breaks of the Cython layout:\n" + "\n".join(found)


def test_every_folder_is_a_package_and_a_layer():
    ranks, _ = _ranks()
    folders = {p.parent for p in LIB.rglob("*.pxd")}
    for folder in folders:
        assert (folder / "__init__.pxd").is_file(), folder
    assert {p.relative_to(LIB).parts[0] for p in declaration_files()} - set(OUTSIDE) <= set(ranks)


def test_the_check_finds_each_kind_of_break(tmp_path):
    # A copy of the tree with one break of each kind: each is reported, with its file.
    (tmp_path / "include" / "vmalloc" / "alloc").mkdir(parents=True)
    (tmp_path / "include" / "vmalloc" / "alloc" / "thing.hpp").write_text("")
    (tmp_path / "include" / "vmalloc" / "device").mkdir(parents=True)
    (tmp_path / "include" / "vmalloc" / "device" / "dev.hpp").write_text("")
    lib = tmp_path / "vmalloc" / "_lib"
    for folder in ("alloc", "device"):
        (lib / folder).mkdir(parents=True)
    (tmp_path / "vmalloc" / "_wrapper.pyx").write_text(
        'cdef extern from "vmalloc/alloc/thing.hpp":\n    int x\n')
    (lib / "alloc" / "thing.pxd").write_text(
        'cdef extern from "vmalloc/alloc/thing.hpp":\n    int x\n'
        'cdef extern from "vmalloc/alloc/sibling.hpp":\n    int w\n'  # same layer: fine
        'cdef extern from "vmalloc/device/dev.hpp":\n    int v\n')
    (lib / "alloc" / "quiet.pxd").write_text("")
    (tmp_path / "include" / "vmalloc" / "alloc" / "quiet.hpp").write_text("")
    (lib / "alloc" / "ghost.pxd").write_text(
        'cdef extern from "vmalloc/alloc/ghost.hpp":\n    int y\n')
    (lib / "device" / "dev.pxd").write_text(
        'from vmalloc._lib.alloc.thing cimport x\n'
        'cdef extern from "vmalloc/device/dev.hpp":\n    int z\n')
    found = problems(tmp_path)
    assert found == [
        "vmalloc/_wrapper.pyx:1: declares C/C++ (vmalloc/alloc/thing.hpp); declarations belong "
        "in a .pxd under vmalloc/_lib/",
        "vmalloc/_lib/alloc/ghost.pxd:1: mirrors no header (include/vmalloc/alloc/ghost.hpp)",
        "vmalloc/_lib/alloc/quiet.pxd:1: does not declare its header vmalloc/alloc/quiet.hpp",
        "vmalloc/_lib/alloc/thing.pxd:1: declares vmalloc/device/dev.hpp, which is not a "
        "header of its layer (alloc)",
        "vmalloc/_lib/device/dev.pxd:1: device cimports vmalloc._lib.alloc.thing (alloc, above)",
    ]
