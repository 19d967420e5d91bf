"""Sphinx configuration of dvla's documentation site (Markdown pages through MyST).

Build it strictly, as tests/test_docs.py does:

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

project = "dvla"
author = "dvla contributors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# `[text](page.md#a-heading)` links resolve to headings down to level 3.
myst_heading_anchors = 3

# Code blocks without a language (diagrams, console output) are shown as they are.
highlight_language = "none"

# Nothing is suppressed: a broken link or a page outside the toctree fails the strict build.
suppress_warnings: list[str] = []

html_theme = "alabaster"
html_title = "dvla"
