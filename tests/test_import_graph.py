"""mpjax's layers: each `mpjax._src` package imports only its own layer and the layers below it.

Bottom to top (CONTRIBUTING.md): `core` (the policy value type, dtype helpers; no Flax);
`kernels` (Pallas) and `analysis` (HLO reading, deviceless targets), side by side and
independent; `fp8` (quantisation and the fp8 `dot_general`; its blockwise GEMMs call a
kernel); `autocast` (the jaxpr rewrite,
its op lists and fp8 hook); `scaling` (loss scales, `loss_scaled`); `flax` (the only layer that
imports Flax: linen/NNX policies, delayed-fp8 modules, model state, `ConvBN`); `inference`;
`report` (`mpjax.report` and `mpjax.numerics`, built on `analysis`; no Flax).
Within a layer, modules import downwards as well: no two modules import each other, at any
distance.
The public modules (`mpjax`, `mpjax.policy`, ...) sit on top and only re-export; nothing under
`mpjax._src` imports them.
"""

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "core": 0,
    "kernels": 1,
    "analysis": 1,
    "fp8": 2,
    "autocast": 3,
    "scaling": 4,
    "flax": 5,
    "inference": 6,
    "report": 7,
}
FLAX_LAYERS = {"flax", "inference"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set:
    """Absolute module names `path` imports, at any depth of its code (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def import_graph(root: Path) -> dict:
    """Module name -> the names it imports, for every module of the `mpjax` package under `root`."""
    return {_module_name(p, root): _imports(p) for p in (root / "mpjax").rglob("*.py")}


def layer_of(module: str) -> str | None:
    """The `_src` layer of a module name (`mpjax._src.flax.nnx` -> "flax"), None outside `_src`."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["mpjax", "_src"] else None


def violations(graph: dict) -> list[str]:
    """Every import that breaks the layering rule, as readable lines."""
    modules = set(graph)
    out = []
    for module, names in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            continue
        if layer not in LAYERS:
            out.append(f"{module}: layer {layer!r} is not in LAYERS")
            continue
        for name in sorted(names):
            if name.split(".")[0] == "flax" and layer not in FLAX_LAYERS:
                out.append(f"{module} imports {name}: only {sorted(FLAX_LAYERS)} import Flax")
            if name not in modules and name.rsplit(".", 1)[0] not in modules:
                continue
            target = layer_of(name)
            if target is None:
                out.append(f"{module} imports the public module {name}")
            elif target != layer and LAYERS.get(target, 99) >= LAYERS[layer]:
                out.append(f"{module} ({layer}) imports {name} ({target}): not a layer below")
    return out


def find_cycle(edges: dict) -> list | None:
    """A cycle of the directed graph `edges` (node -> set of nodes), as a closed path, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def package_cycle(graph: dict) -> list | None:
    """A cycle between `_src` layers, or None."""
    edges = {layer: set() for layer in LAYERS}
    for module, names in graph.items():
        src = layer_of(module)
        for name in names:
            dst = layer_of(name)
            if src in edges and dst in edges and dst != src:
                edges[src].add(dst)
    return find_cycle(edges)


def module_cycle(graph: dict) -> list | None:
    """A cycle of imports between modules of one `_src` layer, or None.

    Within a layer, modules import downwards too: a module shared by two others sits below
    both, so no two modules need each other (lazy imports count: they hide a cycle).
    """
    modules = set(graph)
    edges = {m: set() for m in modules}
    for module, names in graph.items():
        for name in names:
            target = name if name in modules else name.rsplit(".", 1)[0]
            same = layer_of(module) is not None and layer_of(target) == layer_of(module)
            if target in modules and target != module and same:
                edges[module].add(target)
    return find_cycle(edges)


def test_every_src_package_is_a_known_layer():
    found = {p.name for p in (ROOT / "mpjax" / "_src").iterdir() if (p / "__init__.py").exists()}
    assert found == set(LAYERS)


def test_no_upward_or_public_import_and_flax_only_in_the_flax_layers():
    assert violations(import_graph(ROOT)) == []


def test_no_cycle_between_layers():
    assert package_cycle(import_graph(ROOT)) is None


@pytest.mark.parametrize(
    "module,line,expected",
    [
        ("core/policy.py", "from mpjax._src.flax import apply", "not a layer below"),
        ("kernels/common.py", "from mpjax._src.fp8 import dot", "not a layer below"),
        ("scaling/checks.py", "import flax.linen", "only ['flax', 'inference'] import Flax"),
        ("autocast/rules.py", "from mpjax.policy import Policy", "imports the public module"),
        ("kernels/stats.py", "    from mpjax._src.autocast import autocast", "not a layer below"),
    ],
)
def test_an_added_bad_import_is_reported(tmp_path, module, line, expected):
    """The checker on a copy of the package with one bad import added (indented: a lazy one)."""
    shutil.copytree(ROOT / "mpjax", tmp_path / "mpjax")
    path = tmp_path / "mpjax" / "_src" / module
    text = path.read_text()
    if line.startswith(" "):
        text += f"\n\ndef _lazy():\n{line}\n"
    else:
        text = f"{line}\n{text}"
    path.write_text(text)
    found = violations(import_graph(tmp_path))
    culprit = "mpjax._src." + module[: -len(".py")].replace("/", ".")
    assert found and all(f.startswith(culprit) and expected in f for f in found), found


def test_no_cycle_between_modules_of_a_layer():
    assert module_cycle(import_graph(ROOT)) is None


def test_a_cycle_between_modules_of_a_layer_is_found():
    graph = {
        "mpjax._src.scaling.a": {"mpjax._src.scaling.b.f", "mpjax._src.core.c"},
        "mpjax._src.scaling.b": {"mpjax._src.scaling.c"},
        "mpjax._src.scaling.c": {"mpjax._src.scaling.a.g"},
        "mpjax._src.core.c": set(),
        "mpjax._src.flax.d": {"mpjax._src.flax.e", "flax.linen"},
        "mpjax._src.flax.e": {"flax.nnx"},  # Flax's own modules are not ours
    }
    a, b, c = (f"mpjax._src.scaling.{m}" for m in "abc")
    assert module_cycle(graph) == [a, b, c, a]
    del graph[c]
    assert module_cycle(graph) is None


def test_a_cycle_between_layers_is_found():
    graph = {
        "mpjax._src.core.a": {"mpjax._src.fp8.b"},
        "mpjax._src.fp8.b": {"mpjax._src.core.a"},
    }
    assert package_cycle(graph) == ["core", "fp8", "core"]


def test_imports(root: Path) -> list[str]:
    """Every import of a test file or of `benchmarks/` by a file under `root/tests`.

    Shared test code lives in `tests/helpers/` (CONTRIBUTING.md); a test module imported by
    another would also run its tests twice under a different name.
    """
    out = []
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                names = [f".{node.module or ''}"] + [f".{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                first, last = name.split(".")[0], name.rsplit(".", 1)[-1]
                ours = first in ("tests", "") and last.startswith("test_")  # "": relative
                if first == "benchmarks" or ours:
                    out.append(f"{path.relative_to(root)} imports {name}")
                    break
    return out


test_imports.__test__ = False  # a checker, not a test


def test_no_test_file_imports_another_test_file_or_the_benchmarks():
    assert test_imports(ROOT) == []


def test_a_test_importing_a_test_file_is_reported(tmp_path):
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_x.py").write_text("from tests.a.test_y import helper\n")
    z = "from . import test_y\nimport benchmarks.run\n"
    (tmp_path / "tests" / "a" / "test_z.py").write_text(z)
    ok = "from tests.helpers.optim import bits\nimport jax.test_util\n"
    (tmp_path / "tests" / "a" / "test_ok.py").write_text(ok)
    assert test_imports(tmp_path) == [
        "tests/a/test_x.py imports tests.a.test_y",
        "tests/a/test_z.py imports .test_y",
        "tests/a/test_z.py imports benchmarks.run",
    ]
