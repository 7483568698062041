"""``import vmalloc`` from the repository root imports the source tree, which has no compiled
modules: the error must say what to do, not just ``No module named 'vmalloc._core.device'``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_from_source_tree_explains_the_shadowing():
    if any((ROOT / "vmalloc" / "_core").glob("device*.so")):
        pytest.skip("the source tree holds compiled modules (an in-place build)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", "import vmalloc"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr, proc.stderr
    assert "source tree" in proc.stderr, proc.stderr
    assert "pip install -e ." in proc.stderr and "scripts/dev-build" in proc.stderr, proc.stderr
    assert str(ROOT / "vmalloc") in proc.stderr, proc.stderr
