"""Sphinx configuration of the documentation site (`make docs`: strict, into site/)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "_ext"), str(HERE.parent / "src"), str(HERE.parent / "kernels")]

project = "asyncllm"
author = "the asyncllm developers"
copyright = "2026, the asyncllm developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "asyncllm_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "glossary-terms.tsv"]
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
html_theme = "furo"
html_title = "asyncllm"
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # (the signatures show them; no cross-reference to resolve)
