"""The tables' shared helpers: cells, a Markdown pipe table, records with their anchor's figures."""

from __future__ import annotations

from typing import Any

from benchmarks.names import number

GIB, MIB = 2**30, 2**20
COMPILE = "compile s (vs anchor)"  # trace + lower + XLA compile, on the run's machine

# --- formatting ------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """A table cell: floats to 4 significant digits (no exponent from 1e4 up), `|` escaped,
    None empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return number(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A GitHub/MyST pipe table."""
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _tflop(flops: dict) -> str:
    return ", ".join(f"{k} {v / 1e12:.3g}" for k, v in sorted(flops.items())) or "-"


def _ratio(value: float, anchor: float | None) -> float | str:
    return round(value / anchor, 3) if anchor else "-"


def _fp8_share(flops: dict, total: float) -> str:
    fp8 = sum(v for k, v in flops.items() if "f8" in k or "f4" in k)
    return f"{100 * fp8 / total:.1f} %" if total else "-"


def _matmul_flops(f: dict) -> dict:
    out = dict(f["gemm_flops"])
    for k, v in f["conv_flops"].items():
        out[k] = out.get(k, 0) + v
    return out


def _block_gemm_flops(cfg: dict) -> float:
    tokens, d = cfg["batch"] * cfg["seq"], cfg["d"]
    return 3 * 2 * tokens * cfg["layers"] * (4 * d * d + 2 * d * cfg["mlp"])


def _f32(f: dict) -> str:
    return f"{f['gemms_by_dtype'].get('f32', 0)}/{f['convs_by_dtype'].get('f32', 0)}"


# --- the records -----------------------------------------------------------------------------


def _ok(results: dict, table: str) -> list[dict]:
    return [r for r in results["records"] if r["table"] == table and r["status"] == "ok"]


def _with_anchor(records: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each record with the figures of its anchor (same model, size and target)."""
    by_key = {(r["model"], r.get("size"), r["target"], r["variant"]): r for r in records}
    out = []
    for r in records:
        a = by_key.get((r["model"], r.get("size"), r["target"], r["anchor"]))
        out.append((r, a and a["figures"]))
    return out


def _compile_cell(f: dict, a: dict | None) -> str:
    """Seconds to trace, lower and compile the step, with the ratio to the anchor's."""
    if "compile_s" not in f:
        return "-"  # a record from before compile times were recorded
    total = f["trace_s"] + f["compile_s"]
    if a is None or "compile_s" not in a:
        return f"{total:.1f}"
    return f"{total:.1f} ({total / (a['trace_s'] + a['compile_s']):.2f}x)"


def _size(r: dict) -> str:
    return r.get("size") or r["model"]
