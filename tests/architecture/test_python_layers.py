"""The Python tree's layering, the counterpart of test_layering.py for the C++ tree:

    base (errors, sizes, _core.stats) <- device (vmalloc._core: the compiled device, chunk
    pool and allocator wrappers; the driver emulator) <- alloc (allocator_kinds) <- trace
    (vmalloc.traces) <- replay (vmalloc.replay with its stress patterns, plot and verdict;
    bench) <- offload <- frameworks (vmalloc.frameworks, torch, cupy, nnabla, cuda_core,
    xgboost, the NumPy demo) <- cli (vmalloc.cli with doctor and probe, offload.cli)

and inside offload, one layer per folder (docs/architecture.rst, "The offload package"):

    {offload.swap, offload.sequence, offload.hardware} <- {offload.scheduling, offload.pages} <-
    {offload.simulation, offload.runtime} <- offload.planning <- offload (the package's
    facade, ``vmalloc.offload``, re-exporting the public names)

A module may import modules of its own layer and of the layers below it, never of a layer
above it nor of a sibling (another layer of the same rank: the runtime never imports the
simulator, nor the simulator the runtime): every import counts here, those inside functions
too (a lazy import still ties the lower module to the higher one). A module inside offload
reaches another folder's names by that folder's module (``vmalloc.offload.swap``), never
through the facade, which sits above them all. Import cycles are checked among module-level
imports only: an import inside a function is the usual way to break a cycle, and runs after
both modules are initialized. The package root ``vmalloc`` is a facade that re-exports the compiled
classes; lower modules reach those classes through it lazily (``vmalloc.HostDevice``), so
importing the root counts as importing the device layer.

Imports are read with ``ast`` from the ``.py`` files and with a regular expression from the
``.pyx`` files (Python imports only; ``cimport`` is the Cython layout's business,
test_cython_layout.py). The layers are those the code has today (derived from its imports).
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vmalloc"

RANKS = {"base": 0, "device": 1, "alloc": 2, "trace": 3, "replay": 4,
         "offload.swap": 5, "offload.sequence": 5, "offload.hardware": 5,
         "offload.scheduling": 6, "offload.pages": 6, "offload.simulation": 7, "offload.runtime": 7,
         "offload.planning": 8, "offload": 9, "frameworks": 10, "cli": 11}

#: Module (or package prefix) -> layer; the longest matching prefix decides.
LAYERS = {
    "vmalloc": "device",  # the facade re-exporting the compiled classes (see above)
    "vmalloc.errors": "base",
    "vmalloc.sizes": "base",
    "vmalloc._core": "device",  # the compiled device, chunk pool and allocator wrappers
    "vmalloc._core.stats": "base",
    "vmalloc.bench._bench": "device",
    "vmalloc.testing": "device",  # the driver emulator and its fault injection
    "vmalloc.allocator_kinds": "alloc",
    "vmalloc.traces": "trace",
    "vmalloc.replay": "replay",  # with its compiled loop, stress patterns, plot and verdict
    "vmalloc.bench": "replay",
    "vmalloc.offload": "offload",  # the facade (its __init__) re-exporting the public names
    "vmalloc.offload.swap": "offload.swap",
    "vmalloc.offload.sequence": "offload.sequence",
    "vmalloc.offload.hardware": "offload.hardware",
    "vmalloc.offload.scheduling": "offload.scheduling",
    "vmalloc.offload.simulation": "offload.simulation",
    "vmalloc.offload.runtime": "offload.runtime",
    "vmalloc.offload.planning": "offload.planning",
    "vmalloc.offload.pages": "offload.pages",  # page streams: the swap manager's staging
    "vmalloc.offload.cli": "cli",
    "vmalloc.frameworks": "frameworks",  # with the NumPy demo (numpy_training)
    "vmalloc.torch": "frameworks",
    "vmalloc.cupy": "frameworks",
    "vmalloc.nnabla": "frameworks",
    "vmalloc.cuda_core": "frameworks",
    "vmalloc.xgboost": "frameworks",
    "vmalloc.cli": "cli",  # with its errors, doctor and probe
    "vmalloc.__main__": "cli",
}

#: Imports of a higher layer known today, each (importer, imported) with why it stays; the
#: coordinator removes them as they are fixed.
KNOWN_EXCEPTIONS = {
    # `import vmalloc; vmalloc.traces.open_trace(...)` is a public path: the facade imports the
    # trace package. Harmless while nothing in vmalloc.traces imports the root at module
    # level (test_no_import_cycles_among_module_level_imports); a module-level __getattr__
    # (PEP 562) would make it lazy but still an import of a higher layer.
    ("vmalloc", "vmalloc.traces"),
}

_PYX_IMPORT = re.compile(
    r"^(?P<indent>\s*)(?:from\s+(?P<base>vmalloc[\w.]*)\s+import\s+(?P<names>[^#]*)"
    r"|import\s+(?P<module>vmalloc[\w.]*))")


def modules():
    """Module name -> source path, for every .py and .pyx file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.pyx")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _raw_imports(name, path):
    """(inside a function?, imported module, imported names) for each import statement."""
    if path.suffix == ".pyx":
        out = []
        for line in path.read_text().splitlines():
            m = _PYX_IMPORT.match(line)
            if m and "cimport" not in line:
                names = [n.strip(" ()\\").split(" as ")[0].strip()
                         for n in (m["names"] or "").split(",")] if m["base"] else []
                out.append((bool(m["indent"]), m["base"] or m["module"], [n for n in names if n]))
        return out
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((nested, a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against the importing package
                    parts = package.split(".")
                    parts = parts[:len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([child.module] if child.module else []))
                out.append((nested, base, [a.name for a in child.names]))
            visit(child, nested or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def import_edges(mods):
    """{(importer, imported, inside a function)} among the package's modules: ``from a import
    b`` imports the module a.b when there is one, else a."""

    def known(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = set()
    for name, path in mods.items():
        for nested, base, names in _raw_imports(name, path):
            if base != "vmalloc" and not base.startswith("vmalloc."):
                continue
            targets = {f"{base}.{n}" if f"{base}.{n}" in mods else known(base)
                       for n in names} or {known(base)}
            edges.update((name, t, nested) for t in targets if t and t != name)
    return edges


def layer_of(name):
    best = max((prefix for prefix in LAYERS
                if name == prefix or name.startswith(prefix + ".")), key=len, default=None)
    return None if best is None else LAYERS[best]


def upward_imports(edges):
    """The imports of a higher layer or of a sibling (another layer of the same rank), as
    sorted (importer, its layer, imported, its layer)."""
    out = set()
    for src, dst, _ in edges:
        a, b = layer_of(src), layer_of(dst)
        if (RANKS[a] < RANKS[b] or (a != b and RANKS[a] == RANKS[b])) \
                and (src, dst) not in KNOWN_EXCEPTIONS:
            out.add((src, a, dst, b))
    return sorted(out)


def cycles(graph):
    """The strongly connected components of more than one module (or a module importing
    itself) of ``graph`` ({module: set of modules}), each sorted (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def module_level_graph(edges):
    graph = {}
    for src, dst, nested in edges:
        if not nested:
            graph.setdefault(src, set()).add(dst)
    return graph


def test_every_module_has_a_layer():
    missing = sorted(name for name in modules() if layer_of(name) is None)
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_the_layers_are_known():
    assert set(LAYERS.values()) <= set(RANKS)


def test_no_module_imports_a_higher_layer():
    bad = upward_imports(import_edges(modules()))
    assert not bad, "\n".join(f"{s} ({a}) imports {d} ({b})" for s, a, d, b in bad)


def test_every_offload_module_is_in_a_concern_folder():
    """Issue 22 item 7: vmalloc/offload/ holds its facade (__init__.py) and one folder per
    concern, each a layer above; a module left at its top would fall in the facade's layer."""
    top = sorted(name for name in modules() if name.startswith("vmalloc.offload.")
                 and name.count(".") == 2 and layer_of(name) == "offload")
    assert top == []
    folders = {name.split(".")[2] for name in modules() if name.count(".") >= 3
               and name.startswith("vmalloc.offload.")}
    assert folders == {"swap", "sequence", "hardware", "scheduling", "pages", "simulation",
                       "runtime", "planning", "cli"}
    assert {layer_of(f"vmalloc.offload.{f}") for f in folders} <= set(RANKS)


def test_the_offload_folders_import_one_way():
    # The order the code has (not only what the check allows): each folder imports the one
    # below it, so the ranks are no looser than the imports.
    edges = {(layer_of(s), layer_of(d)) for s, d, _ in import_edges(modules())}
    assert ("offload.scheduling", "offload.sequence") in edges    # recompute: the sequence
    assert ("offload.scheduling", "offload.hardware") in edges    # recompute: the GPU's costs
    assert ("offload.simulation", "offload.scheduling") in edges  # simulator: Schedule, Step
    assert ("offload.runtime", "offload.scheduling") in edges     # recording: make_scheduler
    assert ("offload.runtime", "offload.swap") in edges           # core: SwapManager
    assert ("offload.planning", "offload.simulation") in edges    # planner: simulate
    assert ("frameworks", "offload.runtime") in edges             # the drivers: Runtime


def test_no_import_cycles_among_module_level_imports():
    assert cycles(module_level_graph(import_edges(modules()))) == []


def test_the_edges_are_read():
    # The checks see real imports: module-level, lazy, relative and "from package import
    # module" forms, and the .pyx files'.
    edges = import_edges(modules())
    assert ("vmalloc.replay.result", "vmalloc._core.stats", False) in edges
    assert ("vmalloc.traces._fast", "vmalloc.traces.kineto", True) in edges
    assert ("vmalloc.replay", "vmalloc.allocator_kinds", False) in edges
    assert ("vmalloc.replay._replay", "vmalloc.traces.events", False) in edges


def test_the_checks_catch_what_they_guard_against():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    edges = {("vmalloc.sizes", "vmalloc.replay.run", True),
             ("vmalloc.replay.run", "vmalloc.sizes", False)}
    assert upward_imports(edges) == [("vmalloc.sizes", "base", "vmalloc.replay.run", "replay")]
    # A lazy import breaks a cycle but not the layering.
    assert cycles(module_level_graph(edges)) == []
    # Siblings: the runtime and the simulator never import each other; a folder reaching
    # another through the facade imports a higher layer.
    assert upward_imports({("vmalloc.offload.runtime.core",
                            "vmalloc.offload.simulation.simulator", True),
                           ("vmalloc.offload.runtime.core", "vmalloc.offload", True),
                           ("vmalloc.offload.runtime.core", "vmalloc.offload.swap", True)}) == [
        ("vmalloc.offload.runtime.core", "offload.runtime", "vmalloc.offload", "offload"),
        ("vmalloc.offload.runtime.core", "offload.runtime",
         "vmalloc.offload.simulation.simulator", "offload.simulation")]


#: Files over the limit, each with why it stays for now (the coordinator removes them).
LONG_FILES = {
    # Being split by the trace work of issue 17 (its own area this session).
    "vmalloc/traces/_trace_parse.pyx",
}


def test_the_runtime_split_by_concern_keeps_each_file_under_400_lines():
    """Issue 15: the Runtime is assembled from one module per concern, none over 400 lines (a
    concern that grows past it becomes its own module, as recompute, compression and scopes)."""
    runtime = ROOT / "vmalloc" / "offload" / "runtime"
    long = {p.name: n for p in runtime.glob("*.py")
            if (n := p.read_text().count("\n")) > 400}
    assert long == {}


def test_no_python_file_over_500_lines():
    long = sorted(str(p.relative_to(ROOT)) for p in modules().values()
                  if p.read_text().count("\n") > 500)
    assert [p for p in long if p not in LONG_FILES] == []
