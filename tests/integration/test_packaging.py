"""The package ships what an installed copy needs: the PEP 561 marker and its data files."""

from __future__ import annotations

import importlib.resources
import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_data() -> dict[str, list[str]]:
    """`[tool.setuptools.package-data]` of pyproject.toml: package -> file patterns."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def test_py_typed_is_package_data():
    assert (ROOT / "mpjax" / "py.typed").is_file()
    assert any(fnmatch("py.typed", pattern) for pattern in package_data().get("mpjax", []))
    assert importlib.resources.files("mpjax").joinpath("py.typed").is_file()


def test_every_declared_data_pattern_matches_a_file():
    for package, patterns in package_data().items():
        folder = ROOT.joinpath(*package.split("."))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern!r} matches no file"
