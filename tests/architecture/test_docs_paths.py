"""Documented classes live at public paths (issue 22 item 7): the docs never document or link a
class, an exception or a module through a private module (a path component starting with an
underscore, such as ``vmalloc._core.physical_chunk_pool``); a public class is exported where
users import it (``vmalloc.PhysicalChunkPool``) and documented there."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: ``.. autoclass:: path`` (any auto directive) and ``:class:`~path``` (class, exception, module
#: and function roles).
_TARGET = re.compile(r"(?:\.\.\s+auto\w+::\s+|:(?:class|exc|mod|func|meth):`~?)([\w.]+)")

#: Private paths known today, each with why it stays (the coordinator removes them).
KNOWN = set()


def private_paths(text):
    """The documented paths of ``text`` with a private component (``_x``; dunder names such as
    ``__init__`` are not private)."""
    out = []
    for match in _TARGET.finditer(text):
        path = match.group(1)
        if any(p.startswith("_") and not p.endswith("__") for p in path.split(".")):
            out.append(path)
    return out


def test_no_documented_path_goes_through_a_private_module():
    found = sorted(f"{page.relative_to(ROOT)}: {path}"
                   for page in sorted(DOCS.glob("*.rst")) + sorted(DOCS.glob("*.md"))
                   for path in private_paths(page.read_text(encoding="utf-8"))
                   if path not in KNOWN)
    assert found == []


def test_the_check_sees_each_form():
    text = (".. autoclass:: vmalloc._core.pool.Pool\n"
            "A :class:`~vmalloc._core.pool.Pool`, :mod:`vmalloc.traces._fast`, "
            ":class:`vmalloc.PhysicalChunkPool`, :func:`vmalloc.offload.plan`.\n"
            ".. autofunction:: vmalloc.offload._private\n")
    assert private_paths(text) == ["vmalloc._core.pool.Pool", "vmalloc._core.pool.Pool",
                                   "vmalloc.traces._fast", "vmalloc.offload._private"]
