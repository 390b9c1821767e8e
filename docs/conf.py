"""Sphinx configuration of the mpjax documentation (Sphinx + MyST, as jax, optax and flax).

Build, warnings as errors, from the repository root:

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout's mpjax, not an installed copy
sys.path.insert(0, str(DOCS))

from example_outputs import OUTPUTS, facts, read_outputs, write_example_outputs  # noqa: E402
from memory_switch_tables import write_memory_switch_tables  # noqa: E402

import mpjax  # noqa: E402
from benchmarks.tables import write_docs  # noqa: E402

# The performance and memory pages' tables and plots are generated on every build from
# benchmarks/results.json, which one command writes: `python benchmarks/run.py`; the real-GPU
# tables from benchmarks/results-gpu.json, which `python benchmarks/gpu.py` writes on a GPU;
# tables re-measured since that run from the files one `run.py --only ... --json` wrote
# (results-blocks.json: the blocks table; results-frontier.json: the memory switches).
NEWER = [ROOT / "benchmarks" / f"results-{name}.json" for name in ("gpu", "blocks", "frontier")]
write_docs(ROOT / "benchmarks" / "results.json", DOCS / "_generated", *NEWER)
# The memory guide's "where the memory goes" section, from the suite's `memory-switches` case.
write_memory_switch_tables(ROOT / "benchmarks" / "results.json", DOCS / "_generated", *NEWER)
# The examples page's outputs and the figures the prose quotes from them ({{ name }}), from
# the recorded run in docs/examples/outputs/.
write_example_outputs(OUTPUTS, DOCS / "_generated")
myst_substitutions = facts(read_outputs(OUTPUTS))

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
myst_enable_extensions = ["colon_fence", "substitution"]
myst_heading_anchors = 3

# API reference: docstrings are Google style (Args:/Returns:); `name` in a docstring is a
# cross-reference where it resolves and code where it does not.
default_role = "py:obj"
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Public names of types whose runtime class lives in a private module: signatures (the modules
# annotate with `from __future__ import annotations`, so autodoc looks the strings up here) and
# the attribute types napoleon reads from class annotations (`_public_type_names`).
autodoc_type_aliases = {"jax.Array": "jax.Array", "jax.export.Exported": "jax.export.Exported"}
PUBLIC_TYPE_NAMES = {
    "jax.jaxlib._jax.Array": "jax.Array",
    "jax._src.export._export.Exported": "jax.export.Exported",
    "optax._src.base.GradientTransformationExtraArgs": "optax.GradientTransformationExtraArgs",
    "optax._src.base.GradientTransformation": "optax.GradientTransformation",
}
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False

html_theme = "furo"
html_title = f"mpjax {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]  # code blocks fit 100 columns; folded tables


_PRIVATE_TYPE = re.compile(r"\bmpjax\._src\.[\w.]*\.(\w+)\b")
_PUBLIC_MODULES = ("mpjax", "mpjax.policy", "mpjax.scaling", "mpjax.fp8", "mpjax.nn")


def public_type(text: str) -> str:
    """`text` with each private type name replaced by its public one.

    `jax.jaxlib._jax.Array` -> `jax.Array`; `mpjax._src.scaling.loss_scale.LossScale` ->
    `mpjax.LossScale` (the first public module exporting it), or `LossScale` when none does.
    """
    for private, public in PUBLIC_TYPE_NAMES.items():
        text = text.replace(private, public)

    def public_name(m: re.Match) -> str:
        for module in _PUBLIC_MODULES:
            if m.group(1) in getattr(importlib.import_module(module), "__all__", ()):
                return f"{module}.{m.group(1)}"
        return m.group(1)

    return _PRIVATE_TYPE.sub(public_name, text)


def _public_type_names(app, what, name, obj, options, lines):
    """The attribute types napoleon wrote (`:type:` lines), by their public names."""
    for i, line in enumerate(lines):
        if ":type:" in line:
            lines[i] = public_type(line)


def _public_signature(app, what, name, obj, options, signature, return_annotation):
    """A signature's types by their public names."""
    return (
        public_type(signature) if signature else signature,
        public_type(return_annotation) if return_annotation else return_annotation,
    )


def setup(app):
    app.connect("autodoc-process-docstring", _public_type_names, priority=600)  # after napoleon
    app.connect("autodoc-process-signature", _public_signature)
