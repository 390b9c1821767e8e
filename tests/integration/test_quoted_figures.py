"""One number per fact: every figure README.md and docs/ quote from an example's run is the
recorded run's (`docs/examples/outputs/`, included at docs build time) or the benchmark
results file's (`benchmarks/results.json`, tables generated at docs build time).

A number typed by hand into a page fails here: the README's copy of the digits table must
equal the recorded output, quoted minutes, seconds and byte counts must equal the recorded
run's (`docs/example_outputs.facts`), and no page may carry a literal copy of an output line or
of a char-LM bits/byte figure (those come through an include).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))

from example_outputs import (  # noqa: E402
    COMMANDS,
    OUTPUTS,
    facts,
    page,
    read_outputs,
    table_lines,
    table_rows,
)


def doc_pages() -> list[Path]:
    """README.md and every hand-written Markdown page of the docs (not generated ones)."""
    pages = sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0][0] == "_")
    return [ROOT / "README.md", *pages]


def substituted(text: str, values: dict[str, str]) -> str:
    """`text` with each MyST substitution `{{ name }}` replaced as the docs build does."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values[m.group(1)], text)


# A quoted figure: (pattern whose group 1 is the figure, the fact it must equal).
QUOTES = (
    (r"digits\.mpjax \((\d+) bytes\)", "export_bytes"),
    (r"[Aa]bout\s+([\d.]+)\s+minutes\s+on\s+2\s+CPU\s+cores", "digits_minutes"),
    (r"wall\s+times\s+add\s+up\s+to\s+(\d+)\s+s", "digits_wall_s"),
    (r"loses\s+(\d+)\s+%\s+of\s+its\s+gradient", "underflow_flushed"),
)


def quoted_mismatches(pages: dict[str, str], values: dict[str, str]) -> list[str]:
    """Every quoted figure of `pages` (name -> text) that is not the recorded run's."""
    bad = []
    for name, text in pages.items():
        text = substituted(text, values)
        for pattern, fact in QUOTES:
            for m in re.finditer(pattern, text):
                if m.group(1) != values[fact]:
                    bad.append(
                        f"{name}: {m.group(0)!r}: the recorded run's {fact} is {values[fact]}"
                    )
    return bad


def copied_lines(pages: dict[str, str], outputs: dict[str, str]) -> list[str]:
    """Lines of a recorded output (or of its table) that a page repeats by hand."""
    lines = {
        line.strip()
        for text in outputs.values()
        for line in text.splitlines()
        if re.search(r"\d", line) and len(line.strip()) > 12
    }
    return [
        f"{name}: {line!r} is a copy of a recorded output: include it instead"
        for name, text in pages.items()
        for line in (raw.strip() for raw in text.splitlines())
        if line in lines
    ]


def results_char_lm_figures(results: dict) -> set[str]:
    """The char-LM bits/byte figures of the results file, as the generated tables print them."""
    out = set()
    for r in results["records"]:
        f = r.get("figures") or {}
        if r["table"] == "convergence":
            out |= {f"{row['val_bits_per_byte']:.4f}" for row in f["char_lm"]["rows"]}
        if r["table"] == "memory-switches-char-lm":
            out |= {f"{v['mean']:.4f}" for v in f["details"]["runs"].values()}
    return out


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    return read_outputs()


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in doc_pages()}


def test_every_example_on_the_page_has_a_recorded_output(outputs):
    page_text = (DOCS / "examples" / "index.md").read_text()
    for name, command in COMMANDS.items():
        assert command.split(" --no-progress")[0] in page_text, name
        assert f"_generated/example_{name}.md" in page_text, f"{name}'s output is not included"
        assert outputs[name].strip(), name


def test_readme_digits_table_is_the_recorded_run_without_wall_times(outputs):
    recorded = table_rows(outputs["train_digits"])
    wall = recorded[0].index("wall time (s)")
    expected = [[c for i, c in enumerate(row) if i != wall] for row in recorded]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Mixed precision matches float32") :]
    assert table_rows(section) == expected


def test_quoted_figures_are_the_recorded_runs(pages, outputs):
    values = facts(outputs)
    assert not quoted_mismatches(pages, values)
    quoted = "".join(substituted(t, values) for t in pages.values())
    for pattern, fact in QUOTES[1:]:  # the prose still quotes these (the bytes are included)
        assert re.search(pattern, quoted), (pattern, fact)


def test_a_figure_edited_by_hand_is_caught(pages, outputs):
    values = facts(outputs)
    readme = pages["README.md"]
    m = re.search(QUOTES[1][0], readme)
    wrong = str(float(m.group(1)) + 1).removesuffix(".0")
    edited = readme[: m.start(1)] + wrong + readme[m.end(1) :]
    assert quoted_mismatches({"README.md": edited}, values)
    page_text = pages["docs/examples/index.md"]
    typed = page_text.replace("{{ digits_wall_s }}", str(int(values["digits_wall_s"]) + 1))
    assert quoted_mismatches({"page": typed}, values)
    digits = "\n".join(table_lines(outputs["train_digits"]))
    assert copied_lines({"page": page_text + "\n" + digits}, outputs)


def test_no_page_copies_an_example_output_by_hand(pages, outputs):
    docs_pages = {k: v for k, v in pages.items() if k != "README.md"}
    assert not copied_lines(docs_pages, outputs)


def test_char_lm_bits_per_byte_is_one_number(pages, outputs):
    """The example's bf16 bits/byte (3 decimals) is the results file's, and no page types a
    char-LM figure of the results file by hand (the tables are generated from it)."""
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    (conv,) = [r for r in results["records"] if r["table"] == "convergence"]
    same_run = [
        r["val_bits_per_byte"]
        for r in conv["figures"]["char_lm"]["rows"]
        if (r["param_dtype"], r["optimizer_state"]) == ("f32", "f32")
    ]
    assert f"{same_run[0]:.3f}" == facts(outputs)["char_lm_bf16"]
    figures = results_char_lm_figures(results)
    for name, text in pages.items():
        typed = figures & set(re.findall(r"\d\.\d{4}", text))
        assert not typed, f"{name} types the results file's char-LM figures {typed} by hand"


def test_outputs_render_as_their_table_or_their_text(outputs):
    assert page(outputs["train_digits"]).startswith("| precision |")
    assert page(outputs["quickstart"]).startswith("```text\nstep   0")


def test_a_missing_output_names_its_command(tmp_path):
    (tmp_path / "quickstart.txt").write_text("step 0")
    with pytest.raises(FileNotFoundError, match="python examples/train_digits.py"):
        read_outputs(tmp_path)


def test_recorded_outputs_are_committed():
    assert sorted(p.stem for p in OUTPUTS.glob("*.txt")) == sorted(COMMANDS)
