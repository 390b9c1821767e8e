"""The documentation builds with warnings as errors, and every public name has an API entry.

The build is the documented command (CONTRIBUTING / docs/conf.py):
`python -m sphinx -W --keep-going -b html docs docs/_build/html`; here it writes to a
temporary folder and the test reads the built inventory (`objects.inv`).
"""

from __future__ import annotations

import importlib
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
    inventory = {"mpjax.nn", "mpjax.nn.ConvBN"}
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
