"""Writes the memory guide's "where the memory goes" tables from `benchmarks/memory_switches.json`.

Every figure comes from the JSON that one run of
`python benchmarks/memory_switches.py --json benchmarks/memory_switches.json`
writes (run by conf.py); one Markdown file lands in `docs/_generated/` (git-ignored).

    python docs/memory_switch_tables.py benchmarks/memory_switches.json docs/_generated
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.tables import markdown_table

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
    """Per-GPU memory of each switch alone and all together, against both anchors."""
    cols = result["columns"]
    keep = [0, 3, 4, 5] + list(range(6, len(cols)))
    rows = [[row[i] for i in keep] for row in result["rows"]]
    return markdown_table([cols[i] for i in keep], rows) + "\n\n" + result["notes"] + "\n"


def char_lm_section(result: dict) -> str:
    """Validation bits/byte of the char-LM example with and without fp8 saved activations."""
    c = result.get("char_lm")
    if not c:
        return "The char-LM runs were skipped in this run (`--no-char-lm`).\n"
    rows = [
        [label, f"{v['mean']:.4f}", ", ".join(f"{x:.4f}" for x in v["bits_per_byte"])]
        for label, v in c["runs"].items()
    ]
    text = markdown_table(["char-LM (bf16 compute)", "val bits/byte (mean)", "per seed"], rows)
    return (
        text
        + f"\n\nRatio {c['ratio']:.4f} ({c['steps']} steps, {c['seeds']} seeds; "
        + f"`{c['command']}`).\n"
    )


def write_memory_switch_tables(json_path: Path, out_dir: Path) -> list[Path]:
    """Writes `memory_switches.md` from the JSON (a note when it is missing)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if not Path(json_path).exists():
        text = f"(not generated: run `benchmarks/memory_switches.py --json {json_path}`)\n"
        return write_pages(out_dir, {"memory_where": text, "memory_switches": text})
    result = json.loads(Path(json_path).read_text())
    pages = {
        "memory_where": where_section(result),
        "memory_switches": switch_section(result) + "\n" + char_lm_section(result),
    }
    return write_pages(out_dir, pages)


if __name__ == "__main__":
    for p in write_memory_switch_tables(Path(sys.argv[1]), Path(sys.argv[2])):
        print(p)
