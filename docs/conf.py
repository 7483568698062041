"""Sphinx configuration for vmalloc's documentation."""

project = "vmalloc"
author = "the vmalloc developers"
copyright = "2026, the vmalloc developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",  # docs/benchmarks.md and other Markdown pages
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
html_static_path = ["_static"]
