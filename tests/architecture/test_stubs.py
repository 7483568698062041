"""Every compiled module (vmalloc/**/*.pyx) has a .pyi stub beside it, shipped with the
package, naming each of its public names and each public member of its classes, so that type
checkers and IDEs see the whole API. scripts/make-stubs writes them from the built modules."""

import ast
import importlib
import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYX = sorted((ROOT / "vmalloc").rglob("*.pyx"))


def module_name(pyx):
    return ".".join(pyx.relative_to(ROOT).with_suffix("").parts)


def stub_names(tree):
    """Top-level names of a stub, and {class name: its member names}."""
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            # Only "import x as x" re-exports a name from a stub (PEP 484).
            names.update(a.asname for a in node.names if a.asname == a.name)
    return names, members


def public(obj):
    return sorted(n for n in dir(obj) if not n.startswith("_")
                  and not inspect.ismodule(getattr(obj, n)))


def test_there_are_compiled_modules():
    assert {module_name(p) for p in PYX} >= {"vmalloc._core.allocator", "vmalloc._core.host_device",
                                             "vmalloc.offload.swap._swap_manager"}


@pytest.mark.parametrize("pyx", PYX, ids=module_name)
def test_the_stub_names_every_public_name(pyx):
    stub = pyx.with_suffix(".pyi")
    assert stub.exists(), f"no stub {stub.relative_to(ROOT)}: run scripts/make-stubs"
    names, members = stub_names(ast.parse(stub.read_text(), str(stub)))
    module = importlib.import_module(module_name(pyx))
    assert [n for n in public(module) if n not in names] == []
    for cls_name, in_stub in members.items():
        cls = getattr(module, cls_name)
        own = [n for n in public(cls) if n in vars(cls)]
        assert [n for n in own if n not in in_stub] == [], cls_name
    # Shipped beside the compiled module (the wheel's packages and scripts/dev-build's links).
    assert pathlib.Path(module.__file__).with_name(stub.name).exists()


def test_the_wheel_keeps_the_stubs():
    text = (ROOT / "pyproject.toml").read_text()
    exclude = next(line for line in text.splitlines() if line.startswith("wheel.exclude"))
    assert "pyi" not in exclude and "py.typed" not in exclude
    assert (ROOT / "vmalloc" / "py.typed").exists()  # PEP 561: type checkers read the stubs
