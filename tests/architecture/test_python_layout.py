"""Where things live in the Python tree (docs/architecture.rst, "The Python tree"):

* at most 20 entries at the top of ``vmalloc/`` (files and folders, stubs and declarations
  included), so that a newcomer sees the package's concerns, not its modules;
* no compiled module (``.pyx``) at the top: the device, chunk pool and allocator wrappers live
  in ``vmalloc/_core/`` (mirroring the declarations in ``vmalloc/_lib/``), every other one
  beside its user: all the modules importing it are in its own package (``traces/``,
  ``replay/``, ``bench/``, ``offload/swap/``, ``offload/scheduling/``).

Test_python_layers.py reads the imports; this file reuses its reader.
"""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vmalloc"
MAX_TOP_ENTRIES = 20
#: Made by Python or an in-place build, not part of the tree.
GENERATED = re.compile(r"^__pycache__$|\.so(\.\d+)*$")

_CIMPORT = re.compile(r"^\s*(?:from\s+(vmalloc[\w.]*)\s+cimport|cimport\s+(vmalloc[\w.]*))", re.M)


def _layers():
    spec = importlib.util.spec_from_file_location(
        "_python_layers", ROOT / "tests" / "architecture" / "test_python_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def top_entries(package=PACKAGE):
    return sorted(p.name for p in package.iterdir() if not GENERATED.search(p.name))


def importers(package=PACKAGE):
    """Compiled module name -> the modules (.py, .pyx, .pxd) that import or cimport it."""
    root = package.parent
    mods = {}
    for path in sorted(package.rglob("*.py")) + sorted(package.rglob("*.pyx")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    compiled = {".".join(p.relative_to(root).with_suffix("").parts)
                for p in package.rglob("*.pyx")}
    found = {name: set() for name in compiled}
    for src, dst, _ in _layers().import_edges(mods):
        if dst in found:
            found[dst].add(src)
    for path in sorted(package.rglob("*.pyx")) + sorted(package.rglob("*.pxd")):
        src = ".".join(path.relative_to(root).with_suffix("").parts)
        for match in _CIMPORT.finditer(path.read_text(encoding="utf-8")):
            dst = match.group(1) or match.group(2)
            if dst in found and dst != src:
                found[dst].add(src)
    # A package that loads its modules lazily by name (vmalloc.offload's table of names).
    for name in compiled:
        parent, _, short = name.rpartition(".")
        init = package.parent.joinpath(*parent.split("."), "__init__.py")
        if init.is_file() and re.search(rf"[\"']{short}[\"']", init.read_text()):
            found[name].add(parent)
    return found


def problems(package=PACKAGE):
    """One line per break of the layout."""
    found = []
    top = top_entries(package)
    if len(top) > MAX_TOP_ENTRIES:
        found.append(f"vmalloc/ has {len(top)} entries at its top, more than "
                     f"{MAX_TOP_ENTRIES}: move modules into the package of their concern")
    for pyx in sorted(package.glob("*.pyx")):
        found.append(f"vmalloc/{pyx.name}: a compiled module at the top of vmalloc/ (the "
                     "wrappers of the core go in vmalloc/_core/, the others beside their user)")
    core = package.name + "._core"
    for name, users in sorted(importers(package).items()):
        home = name.rpartition(".")[0]
        if home == package.name or home == core:
            continue
        if not users:
            found.append(f"{name}: no module imports it")
        outside = sorted(u for u in users if u != home and not u.startswith(home + "."))
        if outside:
            found.append(f"{name}: imported from outside its package {home} by "
                         f"{', '.join(outside)}: move it beside its users, or into "
                         f"vmalloc/_core/ if it wraps the core")
    return found


def test_the_layout_holds():
    found = problems()
    assert not found, "\n".join(found)


def test_the_top_is_small_and_holds_no_compiled_module():
    top = top_entries()
    assert len(top) <= MAX_TOP_ENTRIES, top
    assert not [n for n in top if n.endswith((".pyx", ".pxd", ".pyi", ".hpp"))], top


def test_every_compiled_module_is_in_core_or_beside_its_users():
    users = importers()
    assert {n for n in users if n.startswith("vmalloc._core.")} >= {
        "vmalloc._core.device", "vmalloc._core.host_device", "vmalloc._core.allocator",
        "vmalloc._core.virtual_allocator", "vmalloc._core.physical_chunk_pool"}
    # The others, with the users the check sees (so it reads imports, cimports and lazy names).
    assert users["vmalloc.traces._trace_parse"] == {"vmalloc.traces._fast"}
    assert users["vmalloc.replay._replay"] == {"vmalloc.replay", "vmalloc.replay.run"}
    assert users["vmalloc.bench._bench"] == {"vmalloc.bench"}
    assert users["vmalloc.offload.swap._swap_manager"] == {"vmalloc.offload.swap",
                                                          "vmalloc.offload.swap._staging"}
    assert users["vmalloc.offload.swap._staging"] == {"vmalloc.offload.swap"}
    assert users["vmalloc.offload.scheduling._window_loop"] == {
        "vmalloc.offload.scheduling.window"}
    assert "vmalloc.offload.swap._swap_manager" in users["vmalloc._core.allocator"]  # a cimport


def test_the_check_finds_each_kind_of_break(tmp_path):
    package = tmp_path / "vmalloc"
    (package / "_core").mkdir(parents=True)
    (package / "traces").mkdir()
    (package / "replay").mkdir()
    for n in range(MAX_TOP_ENTRIES - 1):
        (package / f"m{n}.py").write_text("")
    (package / "__pycache__").mkdir()  # not counted
    (package / "_top.pyx").write_text("")
    (package / "_core" / "__init__.py").write_text("")
    (package / "_core" / "device.pyx").write_text("")
    (package / "traces" / "__init__.py").write_text("")
    (package / "traces" / "_parse.pyx").write_text("")
    (package / "traces" / "reader.py").write_text("from vmalloc.traces import _parse\n")
    (package / "replay" / "__init__.py").write_text("")
    (package / "replay" / "run.py").write_text("import vmalloc.traces._parse\n")
    (package / "replay" / "_unused.pyx").write_text("")
    assert problems(package) == [
        f"vmalloc/ has {MAX_TOP_ENTRIES + 3} entries at its top, more than {MAX_TOP_ENTRIES}: "
        "move modules into the package of their concern",
        "vmalloc/_top.pyx: a compiled module at the top of vmalloc/ (the wrappers of the core "
        "go in vmalloc/_core/, the others beside their user)",
        "vmalloc.replay._unused: no module imports it",
        "vmalloc.traces._parse: imported from outside its package vmalloc.traces by "
        "vmalloc.replay.run: move it beside its users, or into vmalloc/_core/ if it wraps the "
        "core",
    ]
