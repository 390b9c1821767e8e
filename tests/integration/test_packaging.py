"""The package ships what an installed copy needs: the PEP 561 marker and its data files, one
version, and an extra that builds the docs."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import re
import sys
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


# --- the `docs` extra builds the docs (issue 44: it lacked matplotlib, which the build's plots
# import) --------------------------------------------------------------------------------------

LOCAL = ("mpjax", "benchmarks", "docs", "examples", "example_outputs", "memory_switch_tables")


def _module_file(name: str) -> Path | None:
    """The checkout's file of module `name` (docs/conf.py puts docs/ on the path), if any."""
    parts = name.split(".")
    if parts[0] in ("example_outputs", "memory_switch_tables"):
        parts = ["docs", *parts]
    for path in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def _optional(node: ast.AST, parents: dict) -> bool:
    """Whether an import sits in a `try` that catches ImportError (an optional package)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            names = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if any("ImportError" in n or "Exception" in n for n in names):
                return True
    return False


def _imports(path: Path, *, module_level_only: bool) -> set[str]:
    """The modules `path` imports (absolute names; optional imports left out); with
    `module_level_only`, those an import of the module runs (not inside functions)."""
    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or _optional(node, parents):
            continue
        if module_level_only and any(
            isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef) for p in _ancestors(node, parents)
        ):
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif node.level:  # relative: from . import x
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            out |= {
                f"{base}.{node.module}" if node.module else f"{base}.{a.name}" for a in node.names
            }
        else:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # a submodule imported by name
    return out


def _ancestors(node, parents):
    while node in parents:
        node = parents[node]
        yield node


def _builds_docs(path: Path) -> bool:
    """Whether `path` is code the docs build runs: docs/*.py and the tables and plots
    (benchmarks/tables*.py). Other modules count by what importing them runs."""
    return path.parent == ROOT / "docs" or path.name.startswith("tables")


def docs_build_imports() -> set[str]:
    """The top-level third-party packages the docs build imports: docs/conf.py and the table
    and plot code it runs (every import, their functions run at the build), the modules these
    import (what importing them runs), the Sphinx extensions and theme, and the documented
    mpjax modules (what importing them runs)."""
    conf = ROOT / "docs" / "conf.py"
    tree = ast.parse(conf.read_text())
    values = {
        t.id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id in ("extensions", "html_theme")
    }
    automodules = set()
    for rst in (ROOT / "docs" / "api").glob("*.rst"):
        automodules |= set(re.findall(r"^\.\. automodule:: (\S+)", rst.read_text(), re.M))
    found = {*values["extensions"], values["html_theme"]}
    todo, seen = [conf, *(_module_file(m) for m in automodules)], set()
    while todo:
        path = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        for name in _imports(path, module_level_only=not _builds_docs(path)):
            top = name.split(".")[0]
            if top in LOCAL:
                todo.append(_module_file(name))
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.add(top)
    return {name.split(".")[0] for name in found}


def _normalized(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _installed_with(requirements: list[str]) -> set[str]:
    """The distributions `pip install` of `requirements` brings: them and, as installed here,
    what they require (without extras)."""
    out, todo = set(), [_normalized(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_normalized(r) for r in requires if "extra ==" not in r]
    return out


def test_the_docs_extra_holds_every_package_the_docs_build_imports():
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    installed = _installed_with(project["dependencies"] + project["optional-dependencies"]["docs"])
    distributions = importlib.metadata.packages_distributions()
    imports = docs_build_imports()
    assert {"matplotlib", "sphinx", "myst_parser", "furo", "jax"} <= imports  # the walk works
    missing = {}
    for name in sorted(imports):
        dists = {_normalized(d) for d in distributions.get(name, [name])}
        if not dists & installed:
            missing[name] = sorted(dists)
    assert not missing, f"the docs build imports, `pip install .[docs]` does not bring: {missing}"


# --- one version: pyproject.toml reads mpjax/_version.py, the CHANGELOG's release is it ----------


def _pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _attr_version(spec: str) -> str:
    """The value of `module.NAME` as setuptools reads an `attr:` (statically, from the source)."""
    module, _, name = spec.rpartition(".")
    tree = ast.parse(_module_file(module).read_text())
    (value,) = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets)
    ]
    return ast.literal_eval(value)


def test_the_package_and_its_metadata_have_one_version():
    import mpjax

    config = _pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    spec = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert _attr_version(spec) == mpjax.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", mpjax.__version__)


def released_sections(changelog: str) -> list[tuple[str, str]]:
    """(version, body) of each `## <version> (<date>)` section of the CHANGELOG, top first."""
    heads = list(re.finditer(r"^## (\d+\.\d+\.\d+)\b.*$", changelog, re.M))
    ends = [h.start() for h in heads[1:]] + [len(changelog)]
    return [(h.group(1), changelog[h.end() : end]) for h, end in zip(heads, ends, strict=True)]


def test_the_changelogs_top_release_is_this_version_and_says_how_to_upgrade():
    import mpjax

    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## Unreleased$", changelog, re.M), "an Unreleased section on top"
    assert changelog.index("## Unreleased") < changelog.index(f"## {mpjax.__version__}")
    (version, body), *older = released_sections(changelog)
    assert version == mpjax.__version__
    assert re.search(r"^### Upgrading from \d+\.\d+", body, re.M), body[:200]
    assert all(v != version for v, _ in older)
