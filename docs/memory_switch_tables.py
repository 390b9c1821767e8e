"""Writes the memory guide's "where the memory goes" tables from the suite's results file.

Every figure comes from the `memory-switches` and `memory-switches-char-lm` records of
`benchmarks/results.json`, the `memory-switches` one from `benchmarks/results-frontier.json`
where that file has it (re-measured since the suite's full run); conf.py runs this at every
build; the Markdown lands in `docs/_generated/` (git-ignored).

    python docs/memory_switch_tables.py benchmarks/results.json docs/_generated \
        benchmarks/results-frontier.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.names import sizes_in_words
from benchmarks.tables import folded
from benchmarks.tables_format import markdown_table

GIB = 2**30


def write_pages(out_dir: Path, pages: dict[str, str]) -> list[Path]:
    """Writes `<name>.md` for each page whose text changed (keeping mtimes); returns the paths."""
    paths = []
    for name, text in pages.items():
        path = Path(out_dir) / f"{name}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:  # keep mtimes: no needless rebuilds
            path.write_text(text)
        paths.append(path)
    return paths


ANCHOR = "anchor: hand-written bf16, XLA attention"


def where_section(result: dict) -> str:
    """The hand-written anchor's temporaries at their peak, by category."""
    anchor = next(r for r in result["details"] if r["row"] == ANCHOR)
    peak = anchor["walk_peak_bytes"]
    rows = [
        [name, f"{b / GIB:.2f}", f"{100 * b / peak:.0f} %"]
        for name, b in anchor["by_category"].items()
        if b / GIB >= 0.005
    ]
    rows.append(["**all temporaries at the peak (liveness walk)**", f"**{peak / GIB:.2f}**", ""])
    rows.append(["XLA's temp (buffer assignment)", f"{anchor['temp_bytes'] / GIB:.2f}", ""])
    rows.append(
        [
            "arguments (the FSDP-sharded state, the batch)",
            f"{anchor['argument_bytes'] / GIB:.2f}",
            "",
        ]
    )
    return markdown_table(["what", "GiB per GPU", "share of the peak"], rows) + "\n"


def switch_section(result: dict) -> str:
    """Per-GPU memory of each switch alone and all together, against both anchors; the walk's
    categories (GiB) in a folded table below."""
    cols = result["columns"]
    wanted = {"step", "temp + args GiB", "roofline ms"}
    short = [i for i, c in enumerate(cols) if c in wanted or c.startswith("vs ")]
    rows = [[row[i] for i in short] for row in result["rows"]]
    text = markdown_table([cols[i] for i in short], rows) + "\n\n"
    by_category = [0] + [i for i in range(1, len(cols)) if i not in short]
    full = markdown_table(
        [cols[i] for i in by_category], [[row[i] for i in by_category] for row in result["rows"]]
    )
    notes = sizes_in_words(result["notes"])
    return text + folded("GiB per GPU by category, each row", full + "\n\n" + notes)


def _commands(command: str) -> list[str]:
    """The commands a study wrote as one with an optional part: `cmd[ --flag x]` -> `cmd`
    and `cmd --flag x`."""
    if "[" not in command or not command.endswith("]"):
        return [command]
    base, optional = command[:-1].split("[", 1)
    return [base.rstrip(), base.rstrip() + " " + optional.strip()]


def _seeds(n: int) -> str:
    return "seed 0" if n == 1 else f"seeds 0-{n - 1}"


def step_seconds(r: dict) -> float:
    """A row's roofline without its collectives (the compute and memory kernels)."""
    return r.get("roofline_s_no_collectives", r["roofline_s"])


def _gib_ms(r: dict) -> tuple[float, float]:
    return (r["temp_bytes"] + r["argument_bytes"]) / GIB, 1e3 * step_seconds(r)


def frontier_section(result: dict) -> str:
    """For each hand-written point: the smallest mpjax step at no more roofline time."""
    rows = [r for r in result["details"] if not r.get("missing") and "roofline_s" in r]
    if not rows:
        return "(the results file has no roofline times: rerun the `memory-switches` case)\n"
    mine = [r for r in rows if not r["hand_written"]]
    out = []
    for h in sorted((r for r in rows if r["hand_written"]), key=step_seconds):
        gib, ms = _gib_ms(h)
        fits = [r for r in mine if step_seconds(r) <= step_seconds(h)]
        if not fits:
            out.append([h["row"], f"{gib:.2f}", f"{ms:.2f}", "none as fast", "-", "-", "-"])
            continue
        best = min(fits, key=lambda r: r["temp_bytes"] + r["argument_bytes"])
        b_gib, b_ms = _gib_ms(best)
        row = [h["row"], f"{gib:.2f}", f"{ms:.2f}", best["row"], f"{b_gib:.2f}", f"{b_ms:.2f}"]
        out.append([*row, f"**{b_gib / gib:.3f}**"])
    columns = ["hand-written step", "GiB", "ms", "smallest mpjax step at <= its time", "GiB"]
    columns += ["ms", "memory ratio"]
    note = (
        "GiB: per GPU, XLA's temporaries plus arguments. ms: the roofline of the compute and "
        "memory kernels, the collectives left out (the table below gives each row's "
        "roofline with them: `hlo_cost` counts a collective's bytes at HBM bandwidth)."
    )
    return markdown_table(columns, out) + "\n\n" + note + "\n"


def char_lm_section(result: dict) -> str:
    """Validation bits/byte of the char-LM example with and without fp8 saved activations."""
    c = result.get("char_lm")
    if not c:
        return "(the `memory-switches-char-lm` case is not in the results file)\n"
    one = c["seeds"] == 1
    rows = [
        [label, f"{v['mean']:.4f}"]
        + ([] if one else [", ".join(f"{x:.4f}" for x in v["bits_per_byte"])])
        for label, v in c["runs"].items()
    ]
    columns = ["char-LM (bf16 compute)", "val bits/byte" if one else "val bits/byte (mean)"]
    text = markdown_table(columns + ([] if one else ["per seed"]), rows)
    commands = " and ".join(f"`{cmd}`" for cmd in _commands(c["command"]))
    return (
        text
        + f"\n\nWith fp8 saved activations over without: {c['ratio']:.4f}x "
        + f"({c['steps']} steps, {_seeds(c['seeds'])}; {commands}).\n"
    )


def _figures(records: list[dict], table: str) -> dict | None:
    ok = [r for r in records if r["table"] == table and r["status"] == "ok"]
    return ok[0]["figures"] if ok else None


def write_memory_switch_tables(results_path: Path, out_dir: Path, *newer: Path) -> list[Path]:
    """Writes `memory_where.md`, `memory_frontier.md` and `memory_switches.md` (a note where
    the case is missing), from `results_path` with the records of the `newer` results files
    in place of its own."""
    from benchmarks.tables import with_records

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    results = json.loads(Path(results_path).read_text()) if Path(results_path).exists() else {}
    records = with_records({"records": results.get("records", [])}, *newer)["records"]
    result = _figures(records, "memory-switches")
    if result is None:
        text = "(not generated: run `python benchmarks/run.py --only memory-switches --resume`)\n"
        names = ("memory_where", "memory_frontier", "memory_switches")
        return write_pages(out_dir, dict.fromkeys(names, text))
    char_lm = _figures(records, "memory-switches-char-lm")
    result = {**result, "char_lm": char_lm and {**char_lm["details"]}}
    pages = {
        "memory_where": where_section(result),
        "memory_frontier": frontier_section(result),
        "memory_switches": switch_section(result) + "\n" + char_lm_section(result),
    }
    return write_pages(out_dir, pages)


if __name__ == "__main__":
    for p in write_memory_switch_tables(Path(sys.argv[1]), Path(sys.argv[2])):
        print(p)
