"""vmalloc.offload's public names (issue 22 item 7: the package in one folder per concern):
every name it exports is the object its concern's module defines, whatever else was imported
first. Before the folders, importing the module ``vmalloc.offload.validate`` (as ``vmalloc
offload validate`` does) made Python set the package's ``validate`` attribute to that module,
so ``vmalloc.offload.validate(...)`` then called a module."""

import importlib
import pkgutil
import subprocess
import sys

import vmalloc.offload as offload


def _modules():
    """Every module of the package that imports without an optional framework (torch)."""
    out = []
    for info in pkgutil.walk_packages(offload.__path__, "vmalloc.offload."):
        try:
            out.append(importlib.import_module(info.name))
        except ImportError as error:
            if "torch" not in str(error):
                raise
    return out


def test_every_export_is_its_modules_object_after_every_module_is_imported():
    names = {m.__name__ for m in _modules()}
    assert {"vmalloc.offload.planning.validate", "vmalloc.offload.simulation.simulator",
            "vmalloc.offload.scheduling.window", "vmalloc.offload.swap._swap_manager",
            "vmalloc.offload.runtime.core", "vmalloc.offload.sequence.sequence"} <= names
    wrong = {}
    for name in offload.__all__:
        module = importlib.import_module(f"vmalloc.offload.{offload._EXPORTS[name]}")
        if getattr(offload, name) is not getattr(module, name):
            wrong[name] = getattr(offload, name)
    assert wrong == {}
    assert callable(offload.validate) and offload.validate.__name__ == "validate"


def test_validate_is_the_function_after_the_cli_imported_its_module(tmp_path):
    # A fresh interpreter, in the order the command line imports things (run outside the
    # source tree, whose vmalloc/ has no compiled modules).
    code = ("import vmalloc.offload.planning.validate, vmalloc.offload as o; "
            "print(type(o.validate).__name__, o.validate.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.split()
    assert out == ["function", "vmalloc.offload.planning.validate"]


def test_the_folders_are_packages_and_nothing_is_left_at_the_top():
    top = sorted(info.name for info in pkgutil.iter_modules(offload.__path__))
    assert top == ["cli", "hardware", "pages", "planning", "runtime", "scheduling", "sequence",
                   "simulation", "swap"]
    assert all(info.ispkg for info in pkgutil.iter_modules(offload.__path__))
