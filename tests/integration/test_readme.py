"""README's promises hold: its Python example runs and its commands are the ones CI runs."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_example_runs_with_the_values_it_claims():
    (example,) = _blocks("python")
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    va, dev = namespace["va"], namespace["dev"]
    # 5 MiB in 2 MiB chunks: 3 chunks mapped, 1 MiB of internal fragmentation while live,
    # and after the free the range stays mapped in the cache.
    stats = va.stats()
    assert stats.live_allocations == 0
    assert stats.peak_allocated_bytes == 3 * 2**20 * 2
    assert stats.peak_internal_fragmentation_bytes == 2**20
    assert stats.reserved_bytes == 6 * 2**20
    assert dev.counters()["map"] == 3


def test_readme_test_command_is_what_ci_runs():
    commands = [b.strip() for b in _blocks("sh")]
    assert 'pip install ".[test]" && pytest' in commands
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install ".[test]" && pytest\n' in ci


def test_readme_main_job_is_out_of_core_training():
    commands = [b.strip() for b in _blocks("sh")]
    assert "pip install . && vmalloc offload train" in commands


def test_readme_lists_the_build_prerequisites_the_build_requires_before_trying_it():
    text = README.read_text()
    early = text[:text.index("## Try it")]
    root = README.parent
    cmake = re.search(r"cmake_minimum_required\(VERSION ([0-9.]+)\)",
                      (root / "CMakeLists.txt").read_text()).group(1)
    std = re.search(r"CMAKE_CXX_STANDARD (\d+)", (root / "CMakeLists.txt").read_text()).group(1)
    python = re.search(r'requires-python = ">=([0-9.]+)"', (root / "pyproject.toml").read_text())
    assert f"C++{std} compiler" in early
    assert f"CMake ≥ {cmake}" in early
    assert f"Python ≥ {python.group(1)}" in early
    # how to import from the source tree, before the first command a user runs
    assert "scripts/dev-build" in early and "PYTHONPATH=" in early


def test_readme_says_replay_ends_with_a_verdict():
    text = README.read_text()
    assert "ends with a verdict" in text and "smallest device that runs the job" in text
