"""The examples' printed outputs, and the figures the docs quote from them, from one run.

`docs/examples/outputs/<example>.txt` is what each example command on the examples page
printed (its stdout) in the run the docs show. `docs/conf.py` runs `write_example_outputs` at
every build: each output as a Markdown include in `docs/_generated/example_<name>.md` (the
table an example prints, or its text), and `facts` gives the figures the prose quotes
(MyST substitutions, `{{ digits_minutes }}`). `tests/integration/test_quoted_figures.py`
checks that every quoted figure in README.md and docs/ is one of these. To record a new run,
run each command of the examples page and save its stdout there:

    python examples/train_digits.py --no-progress > docs/examples/outputs/train_digits.txt
"""

from __future__ import annotations

import re
from pathlib import Path

OUTPUTS = Path(__file__).resolve().parent / "examples" / "outputs"

# example -> the command whose stdout `<example>.txt` holds (the examples page's commands).
COMMANDS = {
    "quickstart": "python examples/quickstart.py",
    "train_digits": "python examples/train_digits.py --no-progress",
    "underflow_demo": "python examples/underflow_demo.py --no-progress",
    "train_char_lm": "python examples/train_char_lm.py --no-progress",
    "data_parallel": "python examples/data_parallel.py --mode pjit --cpu-devices 8 --steps 200",
    "export_inference": "python examples/export_inference.py",
}


def read_outputs(folder: Path = OUTPUTS) -> dict[str, str]:
    """Each example's recorded stdout, by example name.

    Args:
      folder: the folder of `<example>.txt` files.

    Returns:
      `{name: text}` for every example of `COMMANDS`.

    Raises:
      FileNotFoundError: naming the example whose output is missing and the command to record it.
    """
    out = {}
    for name, command in COMMANDS.items():
        path = Path(folder) / f"{name}.txt"
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no recorded output of `{command}`; run it, save stdout"
            )
        out[name] = path.read_text()
    return out


def table_lines(text: str) -> list[str]:
    """The lines of the first pipe table in `text` (header, rule and rows).

    >>> table_lines("x\\n| a | b |\\n|---|---|\\n| 1 | 2 |\\nwrote y")
    ['| a | b |', '|---|---|', '| 1 | 2 |']
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def table_rows(text: str) -> list[list[str]]:
    """The first pipe table of `text` as rows of stripped cells, the header first (no rule).

    >>> table_rows("| a | b |\\n|---|---|\\n| 1 | 2 |")
    [['a', 'b'], ['1', '2']]
    """
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table_lines(text)]
    return [r for r in rows if not all(set(c) <= set("-: ") for c in r)]


def column(rows: list[list[str]], name: str) -> list[str]:
    """The cells of column `name` (below the header)."""
    i = rows[0].index(name)
    return [r[i] for r in rows[1:]]


def _half_minutes(seconds: float) -> str:
    """Seconds to the nearest half minute, as the docs write it: `2.5`, `3`."""
    half = max(1, round(seconds / 30)) / 2
    return f"{half:g}"


def facts(outputs: dict[str, str]) -> dict[str, str]:
    """The figures the docs' prose quotes from the recorded run, by substitution name.

    Args:
      outputs: `read_outputs()`.

    Returns:
      `digits_wall_s` (the digits table's wall times, summed, whole seconds),
      `digits_minutes` (the same to the nearest half minute), `char_lm_minutes`,
      `underflow_minutes`, `underflow_flushed` (the share of the unscaled fp16 gradient
      flushed to zero, %), `export_bytes` (the size the export example printed) and
      `char_lm_bf16` (the char-LM's bf16 bits/byte as printed).
    """
    digits = sum(map(float, column(table_rows(outputs["train_digits"]), "wall time (s)")))
    lm_rows = table_rows(outputs["train_char_lm"])
    lm = sum(map(float, column(lm_rows, "wall time (s)")))
    under_rows = table_rows(outputs["underflow_demo"])
    underflow = sum(map(float, column(under_rows, "wall time (s)")))
    flushed = dict(
        zip(column(under_rows, "precision"), column(under_rows, under_rows[0][-2]), strict=True)
    )
    exported = re.search(r"\((\d+) bytes\) for platforms", outputs["export_inference"])
    bpb = dict(zip(column(lm_rows, "precision"), column(lm_rows, lm_rows[0][1]), strict=True))
    return {
        "digits_wall_s": f"{digits:.0f}",
        "digits_minutes": _half_minutes(digits),
        "char_lm_minutes": f"{lm / 60:.0f}",
        "underflow_minutes": _half_minutes(underflow),
        "underflow_flushed": f"{float(flushed['fp16-noscale'].rstrip('%')):.0f}",
        "export_bytes": exported.group(1) if exported else "?",
        "char_lm_bf16": bpb["bf16"].split()[0],
    }


def page(text: str) -> str:
    """An output as the docs show it: the table it printed (Markdown), else its text."""
    table = table_lines(text)
    if table:
        return "\n".join(table) + "\n"
    return "```text\n" + text.strip("\n") + "\n```\n"


def write_example_outputs(folder: Path, out_dir: Path) -> list[Path]:
    """Writes `example_<name>.md` for each recorded output (keeping unchanged files' mtimes).

    Args:
      folder: the recorded outputs (`docs/examples/outputs`).
      out_dir: where the includes go (`docs/_generated`).

    Returns:
      The paths written or kept.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in read_outputs(folder).items():
        path, shown = out_dir / f"example_{name}.md", page(text)
        if not path.exists() or path.read_text() != shown:
            path.write_text(shown)
        paths.append(path)
    return paths
