"""No import cycle among mpjax's modules; `mpjax.pallas` does not import `mpjax.scaling` at all."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mpjax"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """mpjax modules that `path` imports, at any depth of its code (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in modules:
                out.add(name)
    return out


def _graph() -> dict:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _imports(p, set(files)) for m, p in files.items()}


def _cycle(graph: dict, nodes: set) -> list | None:
    """A cycle of the graph restricted to `nodes`, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m] & nodes):
            if state.get(n) == "open":
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = "done"
        return None

    for m in sorted(nodes):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_cycle_between_pallas_and_scaling():
    graph = _graph()
    # Package __init__ files re-export their submodules; the cycle that matters is between
    # the modules that hold code.
    nodes = {m for m in graph if _in("mpjax.pallas", m) or _in("mpjax.scaling", m)}
    nodes.add("mpjax._dtypes")
    assert _cycle(graph, nodes) is None


def test_pallas_does_not_import_scaling():
    graph = _graph()
    offenders = {
        m: sorted(i for i in imps if _in("mpjax.scaling", i))
        for m, imps in graph.items()
        if _in("mpjax.pallas", m)
    }
    assert not {m: i for m, i in offenders.items() if i}


@pytest.mark.parametrize(
    "graph,cyclic",
    [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": set()}, False)],
)
def test_cycle_finder_finds_cycles(graph, cyclic):
    assert (_cycle(graph, set(graph)) is not None) == cyclic
