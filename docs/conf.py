"""Sphinx configuration of the mpjax documentation (Sphinx + MyST, as jax, optax and flax).

Build, warnings as errors, from the repository root:

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout's mpjax, not an installed copy
sys.path.insert(0, str(DOCS))

from memory_switch_tables import write_memory_switch_tables  # noqa: E402
from memory_tables import write_memory_tables  # noqa: E402
from performance_tables import write_performance_tables  # noqa: E402

import mpjax  # noqa: E402

# The performance page's figures are generated from benchmarks/results.json on every build.
write_performance_tables(ROOT / "benchmarks" / "results.json", DOCS / "_generated")
# The memory guide's, from benchmarks/memory_results.json (`python benchmarks/memory.py`).
write_memory_tables(ROOT / "benchmarks" / "memory_results.json", DOCS / "_generated")
# Its "where the memory goes" section, from `python benchmarks/memory_switches.py`.
write_memory_switch_tables(ROOT / "benchmarks" / "memory_switches.json", DOCS / "_generated")

project = "mpjax"
author = "mpjax authors"
copyright = "mpjax authors"  # noqa: A001 - Sphinx's name
release = mpjax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_generated", "README.md"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# API reference: docstrings are Google style (Args:/Returns:); `name` in a docstring is a
# cross-reference where it resolves and code where it does not.
default_role = "py:obj"
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False

html_theme = "furo"
html_title = f"mpjax {release}"
html_static_path = ["_static"]
