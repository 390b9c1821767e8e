"""docs/guides/errors.md: every row of every section's table raises (or warns) what it says.

Each `## ` section of the page holds one table with the columns
`| Misuse | Example | Raises | Message contains | Fix |`. Each Example is one line of Python,
run with `import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn, mpjax` and
`from flax import nnx`; it must raise the stated exception class (or a subclass), or emit the
stated warning class, with a message containing the stated text.
"""

from __future__ import annotations

import builtins
import re
import warnings
from pathlib import Path

import jax
import pytest

import mpjax

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "errors.md"
COLUMNS = ["Misuse", "Example", "Raises", "Message contains", "Fix"]
_CODE = re.compile(r"^(`+) ?(.*?) ?\1$")


def _code(cell: str) -> str | None:
    """The text of a cell that is exactly one code span (one or two backticks), else None."""
    m = _CODE.match(cell.strip())
    return m.group(2) if m else None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48]


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


def _parse(section: str, lines: list[str]) -> tuple[list[dict], list[str]]:
    """(rows, problems) of one section: a malformed table is a list of problems, not a skip."""
    tables, block = [], []
    for line in [*lines, ""]:
        if line.lstrip().startswith("|"):
            block.append(line)
        elif block:
            tables.append(block)
            block = []
    if len(tables) != 1:
        return [], [f"{section}: {len(tables)} tables, expected exactly one"]
    header, sep, *body = tables[0] + [""] * (2 - min(len(tables[0]), 2))
    problems = []
    if _cells(header) != COLUMNS:
        problems.append(f"{section}: header {_cells(header)} is not {COLUMNS}")
    if not all(set(c) <= set("-: ") and c for c in _cells(sep)) or len(_cells(sep)) != 5:
        problems.append(f"{section}: the second line is not a separator row: {sep!r}")
    if not body:
        problems.append(f"{section}: the table has no rows")
    rows = []
    for n, line in enumerate(body, 1):
        cells = _cells(line)
        if len(cells) != 5:
            problems.append(f"{section} row {n}: {len(cells)} cells, expected 5: {line!r}")
            continue
        misuse, example, raises, contains, fix = cells
        parsed = {k: _code(v) for k, v in (("example", example), ("raises", raises))}
        parsed["contains"] = _code(contains)
        for key, value in parsed.items():
            if not value:
                problems.append(f"{section} row {n}: {key} is not one code span: {line!r}")
        if not misuse or not fix:
            problems.append(f"{section} row {n}: empty Misuse or Fix")
        if all(parsed.values()):
            rows.append({"section": section, "n": n, "misuse": misuse, **parsed})
    return rows, problems


_SECTIONS = _sections(PAGE.read_text())
_PARSED = {name: _parse(name, lines) for name, lines in _SECTIONS.items()}
_ROWS = [row for rows, _ in _PARSED.values() for row in rows]


def _row_id(row: dict) -> str:
    return f"{_slug(row['section'])}-{row['n']}-{_slug(row['misuse'])}"


def _namespace() -> dict:
    ns: dict = {}
    exec(  # noqa: S102 (the namespace the page states)
        "import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn, mpjax\n"
        "from flax import nnx\n",
        ns,
    )
    return ns


def _resolve(name: str) -> type:
    for where in (builtins, mpjax, mpjax.scaling, jax.errors):
        cls = getattr(where, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls
    raise AssertionError(f"Raises names {name!r}, not an exception or warning class")


def test_page_has_the_title_and_a_toctree_entry():
    assert PAGE.read_text().splitlines()[0] == "# Errors and what they mean"
    assert "guides/errors\n" in (PAGE.parents[1] / "index.md").read_text()


@pytest.mark.parametrize("section", sorted(_PARSED), ids=_slug)
def test_section_table_is_well_formed(section):
    rows, problems = _PARSED[section]
    assert not problems, "\n".join(problems)
    assert rows


@pytest.mark.parametrize("row", _ROWS, ids=[_row_id(r) for r in _ROWS])
def test_example_raises_what_the_table_says(row):
    cls = _resolve(row["raises"])
    ns = _namespace()
    if issubclass(cls, Warning):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            exec(row["example"], ns)  # noqa: S102
        messages = [str(w.message) for w in seen if issubclass(w.category, cls)]
        assert messages, f"no {cls.__name__} was warned"
        assert any(row["contains"] in m for m in messages), messages
        return
    with pytest.raises(cls) as err:
        exec(row["example"], ns)  # noqa: S102
    assert row["contains"] in str(err.value)


def test_checker_reports_a_malformed_table():
    """The checker fails on a broken table rather than skipping its rows."""
    header = "| Misuse | Example | Raises | Message contains | Fix |"
    bad_rows = [
        "| m | not code | `ValueError` | `x` | fix |",  # Example not a code span
        "| m | `1/0` | `ZeroDivisionError` | `x` |",  # 4 cells
    ]
    for row in bad_rows:
        _, problems = _parse("S", ["", header, "|---|---|---|---|---|", row])
        assert problems, row
    _, problems = _parse("S", ["| Misuse | Example | Raises | Fix |", "|---|---|---|---|"])
    assert problems
    _, problems = _parse("S", ["no table here"])
    assert problems
    rows, problems = _parse("S", [header, "|---|---|---|---|---|", "| m | `1/0` | `E` | `d` | f |"])
    assert not problems and rows[0]["example"] == "1/0"
