"""The documentation builds with warnings as errors, and every public name has an API entry.

The build is the documented command (CONTRIBUTING / docs/conf.py):
`python -m sphinx -W --keep-going -b html docs docs/_build/html`; here it writes to a
temporary folder and the test reads the built inventory (`objects.inv`).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_MODULES = (
    "mpjax",
    "mpjax.policy",
    "mpjax.scaling",
    "mpjax.fp8",
    "mpjax.pallas",
    "mpjax.nn",
    "mpjax.inference",
    "mpjax.export",
)


def documented_objects(names: set[str]) -> dict[int, str]:
    """`id(obj) -> name` for every inventory name that imports as a Python object."""
    out = {}
    for name in sorted(names):
        module, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr) if module else None
        except (ImportError, AttributeError):
            try:
                obj = importlib.import_module(name)
            except ImportError:
                continue
        if obj is not None:
            out.setdefault(id(obj), name)
    return out


def missing_entries(inventory: set[str], modules=PUBLIC_MODULES) -> list[str]:
    """`module.name` for each name in a module's `__all__` with no API entry.

    A name has an entry when the inventory holds `module.name` itself, or another documented
    public name bound to the same object (a re-export documented at the top level).
    """
    by_id = documented_objects(inventory)
    missing = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            full = f"{module_name}.{name}"
            if full not in inventory and id(getattr(module, name)) not in by_id:
                missing.append(full)
    return missing


def read_inventory(path: Path) -> set[str]:
    """The Python object names of a Sphinx `objects.inv`."""
    from sphinx.util.inventory import InventoryFile

    with path.open("rb") as f:
        inv = InventoryFile.load(f, "", lambda base, uri: uri)
    return {name for kind, entries in inv.items() if kind.startswith("py:") for name in entries}


def test_missing_entries_names_an_undocumented_name():
    inventory = {
        "mpjax.nn",
        "mpjax.nn.ConvBN",
        "mpjax.nn.dot_product_attention",
        "mpjax.nn.linear_cross_entropy",
    }
    assert missing_entries(inventory, ("mpjax.nn",)) == ["mpjax.nn.nchw_to_nhwc"]
    # a re-export counts as documented where the same object is
    assert missing_entries({"mpjax.loss_scaled"}, ("mpjax.scaling",)) == [
        f"mpjax.scaling.{n}"
        for n in importlib.import_module("mpjax.scaling").__all__
        if n != "loss_scaled"
    ]


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    proc = subprocess.run(
        [*cmd, "-d", str(out / ".doctrees"), "docs", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"the docs build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(built_docs):
    for page in ("index", "getting_started", "guides/performance", "api/mpjax", "api/fp8"):
        assert (built_docs / f"{page}.html").is_file(), page


@pytest.mark.slow
def test_every_public_name_has_an_api_entry(built_docs):
    inventory = read_inventory(built_docs / "objects.inv")
    for module in PUBLIC_MODULES:
        assert module in inventory, f"no API page declares {module}"
    assert missing_entries(inventory) == []


EXAMPLE_LIBRARIES = {"__init__.py", "common.py", "digits_cnn.py"}  # imported, not run


def runnable_examples() -> list[str]:
    """The example programs of `examples/` (not the modules they share), by file name."""
    return sorted(
        p.name for p in (ROOT / "examples").glob("*.py") if p.name not in EXAMPLE_LIBRARIES
    )


def test_the_gallery_shows_every_example_with_its_command_and_figures():
    gallery = (ROOT / "docs" / "examples" / "index.md").read_text()
    assert len(runnable_examples()) >= 6
    for name in runnable_examples():
        assert f"python examples/{name}" in gallery, f"{name} has no command in the gallery"
    figures = [m.group(1) for m in re.finditer(r"!\[[^\]]*\]\(([^)]+)\)", gallery)]
    assert len(figures) >= 4
    for figure in figures:
        assert (ROOT / "docs" / "examples" / figure).resolve().is_file(), figure


def test_the_landing_page_leads_with_a_short_example():
    """Its first block is Python of at most 12 lines (test_readme.py runs it, as every page's)."""
    text = (ROOT / "docs" / "index.md").read_text()
    first = re.search(r"^```(\S*)\n(.*?)^```$", text, re.M | re.S)
    assert first and first.group(1) == "python", "index.md: the first code block is not Python"
    assert len(first.group(2).splitlines()) <= 12
    assert "docs-test: skip" not in text[: first.start()]


def private_types(html: str) -> list[str]:
    """Private module paths (`mpjax._src....`, `jax.jaxlib._jax....`) in the signatures and
    attribute types of a built API page."""
    signatures = re.findall(r'<dt class="sig sig-object py".*?</dt>', html, re.S)
    types = re.findall(r'<dt class="field-\w+">Type<span class="colon">.*?</dd>', html, re.S)
    text = " ".join(re.sub(r"<[^>]*>", "", s) for s in signatures + types)
    return sorted(set(re.findall(r"[\w.]*(?:\._src\.|jaxlib\._)[\w.]*", text)))


@pytest.mark.slow
def test_api_pages_show_public_type_names(built_docs):
    pages = sorted((built_docs / "api").glob("*.html"))
    assert {p.stem for p in pages} >= {"mpjax", "scaling", "export"}
    for page in pages:
        assert private_types(page.read_text()) == [], page.name
    assert "jax.Array" in (built_docs / "api" / "mpjax.html").read_text()
