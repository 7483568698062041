"""Every Python code block of README.md and docs/*.rst runs, so that the docs cannot drift.

Each page's blocks run in order, in one namespace (a later block may use an earlier one's
names), in a fresh Python process whose working directory is an empty temporary folder (so a
block that writes a file writes it where a user would, and the source tree's ``vmalloc/`` does
not shadow the built package). A block that cannot run on a CPU-only machine says so with a
marker, and is counted as a skip with its reason:

- in reStructuredText, a comment right before the directive:
  ``.. doc-test: skip (needs a CUDA GPU)``;
- in Markdown, ``<!-- doc-test: skip (reason) -->`` right before the fence;
- in either, a first line ``# doc-test: skip (reason)`` inside the block.

The pages are found by pattern, so pages and blocks added later are run too. A slow block
should be made smaller, not skipped.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.rst")])
SKIP = re.compile(r"doc-test:\s*skip\b\s*(?:\((?P<reason>.*)\))?", re.I)
#: Seconds one page's blocks may take together (they take a few each).
PAGE_TIMEOUT = 240


class Block:
    def __init__(self, page, line, code, skip=None):
        self.page, self.line, self.code, self.skip = page, line, code, skip

    def __repr__(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _skip_reason(code, before):
    """The reason of a skip marker in the block's first line or just before it, or None."""
    first = code.lstrip("\n").split("\n", 1)[0]
    for text in (first if first.lstrip().startswith("#") else "", before):
        m = SKIP.search(text)
        if m:
            return (m.group("reason") or "").strip() or "no reason given"
    return None


def _markdown_blocks(page, text):
    blocks = []
    for m in re.finditer(r"^```(?:python|py)[ \t]*\n(.*?)^```", text, flags=re.S | re.M):
        before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
        line = text.count("\n", 0, m.start()) + 2
        blocks.append(Block(page, line, m.group(1), _skip_reason(m.group(1), before)))
    return blocks


def _rst_blocks(page, text):
    """``.. code-block:: python`` (and ``.. code:: python``, ``.. sourcecode:: python``)
    blocks: the indented lines after the directive and its options."""
    lines = text.split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(?:python|py|python3)\s*$",
                     lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        start = i
        i += 1
        while i < len(lines) and re.match(r"^\s+:\w[\w-]*:", lines[i]):   # directive options
            i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or
                                  len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        code = textwrap.dedent("\n".join(body)).strip("\n") + "\n"
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        before = lines[j] if j >= 0 and lines[j].lstrip().startswith("..") else ""
        blocks.append(Block(page, start + 1, code, _skip_reason(code, before)))
    return blocks


def blocks_of(page):
    text = page.read_text()
    return _markdown_blocks(page, text) if page.suffix == ".md" else _rst_blocks(page, text)


ALL = [b for page in PAGES for b in blocks_of(page)]
RUN = sorted({b.page for b in ALL if not b.skip})

# The runner of one page in its own process: each block in order in one namespace; stops at
# the first that fails and reports it as JSON on the last line of stdout.
_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for b in blocks:
    try:
        exec(compile(b["code"], b["where"], "exec"), namespace)
    except BaseException:
        print(json.dumps({"failed": b["where"], "error": traceback.format_exc(limit=-3)}))
        sys.exit(1)
print(json.dumps({"failed": None}))
"""


#: Pages whose blocks failed when this test came (issue 17), edited by other helpers at the
#: time: expected to fail (not strictly) until their owners fix the block named here, which
#: then makes the entry obsolete: delete it.
KNOWN_FAILING = {}


@pytest.mark.parametrize("page", RUN, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_blocks_run(page, tmp_path, request):
    known = KNOWN_FAILING.get(str(page.relative_to(ROOT)))
    if known:
        request.applymarker(pytest.mark.xfail(reason=known, strict=False))
    blocks = [{"code": b.code, "where": repr(b)} for b in blocks_of(page) if not b.skip]
    docs_before = _tree(ROOT / "docs")
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
    # The build's package, never the source tree's (cwd is tmp_path, not the repository).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).resolve() != ROOT)
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks),
                          capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=PAGE_TIMEOUT)
    last = proc.stdout.strip().rsplit("\n", 1)[-1] if proc.stdout.strip() else "{}"
    try:
        report = json.loads(last)
    except ValueError:
        report = {}
    assert proc.returncode == 0 and report.get("failed", "?") is None, (
        f"{report.get('failed', page)} failed:\n{report.get('error', '')}\n{proc.stderr[-3000:]}")
    assert _tree(ROOT / "docs") == docs_before, "a block wrote into docs/: write where the user is"


def _tree(folder):
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


SKIPPED = [b for b in ALL if b.skip]


@pytest.mark.parametrize("block", SKIPPED or [None], ids=repr)
def test_skipped_blocks_say_why(block):
    """Each skipped block is counted here, one pytest skip with its reason."""
    if block is None:
        return
    assert block.skip != "no reason given", f"{block!r}: a skip marker needs a reason"
    pytest.skip(f"{block!r}: {block.skip}")


def test_the_runner_finds_the_blocks():
    """The extraction itself: README's ten-line example, the rst directives with options,
    and the skip markers in each of their three forms."""
    readme = [b for b in ALL if b.page.name == "README.md"]
    assert readme and "VirtualAllocator" in readme[0].code
    text = textwrap.dedent("""\
        Intro.

        .. code-block:: python
           :caption: one

           a = 1
           if a:
               b = 2

        .. doc-test: skip (needs a CUDA GPU)

        .. code-block:: python

           import cupy

        .. code-block:: python

           # doc-test: skip (writes to /dev)
           open("/dev/x", "w")

        Text after.
        """)
    page = ROOT / "docs" / "x.rst"
    blocks = _rst_blocks(page, text)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (3, "a = 1\nif a:\n    b = 2\n", None),
        (12, "import cupy\n", "needs a CUDA GPU"),
        (16, "# doc-test: skip (writes to /dev)\nopen(\"/dev/x\", \"w\")\n", "writes to /dev")]
    md = "x\n\n<!-- doc-test: skip (GPU) -->\n```python\nimport cupy\n```\n\n```python\nx = 1\n```\n"
    assert [(b.code, b.skip) for b in _markdown_blocks(page, md)] == [
        ("import cupy\n", "GPU"), ("x = 1\n", None)]
