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
