"""The short tables and the plot the performance, memory and fp8 pages lead with.

Each is what a user chooses between, rows named in words (the variant id in small text),
figures as `x` (times the hand-written bf16 step) and GiB, gathered from several tables of
the one results file; a figure a run lacks reads `-`. `tables.write_docs` writes them as
`lead_performance.md`, `lead_memory.md`, `lead_fp8.md` and `fp8_recipes.png`.

    python benchmarks/tables.py benchmarks/results.json docs/_generated benchmarks/results-gpu.json
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.names import GIB, named, words


def _find(records: list[dict], table: str, model: str, variant: str, size=None, target=None):
    """The ok record of `table` for `model`'s `variant` of `size` (None: the model's default
    size), on `target` where given; None if the run has none. Every lookup names its model:
    the cost and real-GPU tables hold GPT-2 small and ResNet-50 rows of the same variants."""
    for r in records:
        if r["table"] != table or r["model"] != model or r["variant"] != variant:
            continue
        if r["status"] == "ok" and r.get("size") == size and target in (None, r["target"]):
            return r
    return None


def _x(records, table, model, variant, key, size=None, target=None) -> str:
    """`variant`'s `key` over its anchor's (same table, model, size and target), as `0.78x`;
    `-` where either is missing."""
    r = _find(records, table, model, variant, size, target)
    a = r and _find(records, table, model, r["anchor"], r.get("size"), r["target"])
    if not (r and a and a["figures"].get(key)):
        return "-"
    if r["variant"] == r["anchor"]:
        return "1 (anchor)"
    return f"{r['figures'][key] / a['figures'][key]:.2f}x"


def _measured(records, model, variant, size=None) -> str:
    """The real-GPU step time over the anchor's (median of alternating rounds), as `0.78x`."""
    r = _find(records, "gpu", model, variant, size)
    if r and r["variant"] == r["anchor"]:
        return "1 (anchor)"
    return f"{r['figures']['time_vs_anchor']['median']:.2f}x" if r else "-"


def _gib(records, table, model, variant, keys, size=None, target=None) -> str:
    r = _find(records, table, model, variant, size, target)
    return f"{sum(r['figures'][k] for k in keys) / GIB:.2f} GiB" if r else "-"


def _table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


# The GPT-2-small paths a user picks between (cost and fp8 tables; real GPU; 8 GPUs).
PERFORMANCE_MODEL = "lm"  # GPT-2 small: the model of every cell of the performance lead
PERFORMANCE_ROWS = (
    ("bf16", "cost"), ("fp32", "cost"), ("policy", "cost"), ("policy-rules", "cost"),
    ("autocast", "cost"), ("fp16-scaled", "cost"), ("policy-lce", "cost"),
    ("fp8-tensorwise", "fp8"), ("fp8-delayed", "fp8"),
)  # fmt: skip


def lead_performance(records: list[dict]) -> str:
    """GPT-2 small, each path: measured step time on a real GPU, the H100 cost model's
    roofline, temp memory of one step, memory per GPU under 8-GPU FSDP."""
    rows, lm = [], PERFORMANCE_MODEL
    for variant, table in PERFORMANCE_ROWS:
        fsdp = ("temp_bytes", "argument_bytes")
        rows.append(
            [
                named(variant),
                _measured(records, lm, variant),
                _x(records, table, lm, variant, "roofline_s", target="h100"),
                _gib(records, table, lm, variant, ("temp_bytes",), target="h100"),
                _gib(records, "multi-gpu", lm, variant, fsdp, "gpt2x8", "h100x8"),
            ]
        )
    cols = ["GPT-2 small, path", "step time, real GPU", "H100 cost model (roofline)"]
    return _table(cols + ["temp memory, 1 GPU", "memory per GPU, 8 GPUs (FSDP)"], rows)


# memory mode -> the convergence study's char-LM row (params, master, AdamW state).
_CHAR_LM_ROW = {
    "state-adamw": ("f32", None, "f32"),
    "state-master": ("bf16", "auto", "f32"),
    "state-remainder": ("bf16", "remainder", "f32"),
    "state-remainder-bf16": ("bf16", "remainder", "bf16"),
    "state-remainder-int8": ("bf16", "remainder", "int8"),
}


def _char_lm(records: list[dict], mode: str) -> str:
    conv = next((r for r in records if r["table"] == "convergence" and r["status"] == "ok"), None)
    want = _CHAR_LM_ROW.get(mode)
    if not (conv and want):
        return "-"
    for row in conv["figures"]["char_lm"]["rows"]:
        got = (row["param_dtype"], row["master_weights"], row["optimizer_state"])
        if got[0] == want[0] and got[2] == want[2] and (want[1] is None or got[1] == want[1]):
            return f"{row['vs_float32_state_pct']:+.2f} %"
    return "-"


def lead_memory(records: list[dict]) -> str:
    """The training-state modes: bytes per param, GiB per GPU (8-way FSDP of GPT-2 small),
    the optimizer step's bytes and the char-LM's bits/byte against float32 state."""
    rows = []
    for r in (r for r in records if r["table"] == "memory" and r["model"] == "opt-lm"):
        f = r["figures"]
        if r["status"] != "ok":
            continue
        rows.append(
            [
                r.get("label", words(r["variant"])) + f" <small>{r['variant']}</small>",
                f"{f['state_bytes'] / f['params']:.0f}",
                f"{f['state_bytes'] / 8 / GIB:.3f} GiB",
                _step_bytes(records, r),
                _char_lm(records, r["variant"]),
            ]
        )
    cols = ["training state", "bytes / param", "per GPU, 8-way FSDP", "optimizer step bytes"]
    return _table(cols + ["char-LM bits/byte vs float32 state"], rows)


def _step_bytes(records: list[dict], r: dict) -> str:
    a = next(
        (x for x in records if x["table"] == "memory" and x["model"] == r["model"]
         and x["variant"] == r["anchor"] and x["status"] == "ok"),
        None,
    )  # fmt: skip
    return f"{r['figures']['bytes'] / a['figures']['bytes']:.2f}x" if a else "-"


# fp8 recipe -> (variant of the cost/gpu tables, row of the blocks-convergence study)
FP8_ROWS = (
    ("fp8-tensorwise", "fp8"), ("fp8-rowwise", None), ("fp8-delayed", None),
    ("fp8-blockwise", "blockwise"), ("fp8-mxfp8", "mxfp8"), ("fp8-nvfp4", "nvfp4"),
)  # fmt: skip


def _roofline_wide(records, variant, target) -> str:
    for table in ("blocks", "fp8"):
        got = _x(records, table, "lm", variant, "roofline_s", "wide", target)
        if got != "-":
            return got
    return "-"


def _fp8_bits(records, recipe) -> str:
    study = next(
        (r for r in records if r["table"] == "blocks-convergence" and r["status"] == "ok"), None
    )
    if not (study and recipe):
        return "-"
    cols = study["figures"]["columns"]
    for row in study["figures"]["rows"]:
        if row[0] == recipe:
            return f"{row[cols.index('val bits/byte')]:.4f}"
    return "-"


def lead_fp8(records: list[dict]) -> str:
    """Each fp8 recipe on the wide LM: measured on a real GPU, the H100 and B200 cost
    models, and the char-LM's bits/byte (bf16: the first row's)."""
    anchor = "1 (anchor)"
    rows = [
        ["bf16, no fp8 <small>bf16</small>", anchor, anchor, anchor, _fp8_bits(records, "bf16")]
    ]
    for variant, recipe in FP8_ROWS:
        rows.append(
            [
                named(variant),
                _measured(records, "lm", variant, "wide"),
                _roofline_wide(records, variant, "h100"),
                _roofline_wide(records, variant, "b200"),
                _fp8_bits(records, recipe),
            ]
        )
    cols = ["recipe", "step time, real H200", "H100 cost model", "B200 cost model"]
    return _table(cols + ["char-LM val bits/byte"], rows)


SHORT = {
    "fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise", "fp8-delayed": "delayed",
    "fp8-blockwise": "blockwise\n(Pallas kernel)", "fp8-mxfp8": "MXFP8", "fp8-nvfp4": "NVFP4",
}  # fmt: skip


def plot_fp8(records: list[dict], path: Path) -> None:
    """The wide LM's step time under each fp8 recipe over bf16: measured on a real GPU and
    on the H100 and B200 cost models (grouped bars; a missing figure leaves a gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (
        ("real H200 (measured)", lambda v: _measured(records, "lm", v, "wide"), "#55a868"),
        ("H100 cost model", lambda v: _roofline_wide(records, v, "h100"), "#4c72b0"),
        ("B200 cost model", lambda v: _roofline_wide(records, v, "b200"), "#dd8452"),
    )
    variants = [v for v, _ in FP8_ROWS]
    fig, ax = plt.subplots(figsize=(7.6, 3.6))
    width = 0.26
    top = 1.0
    for i, (label, get, color) in enumerate(series):
        for j, v in enumerate(variants):
            text = get(v)
            if text == "-":
                continue
            value = float(text.rstrip("x"))
            top = max(top, value)
            x = j + (i - 1) * width
            ax.bar(x, value, width, color=color, label=label)
            ax.text(x, value + 0.01 * top, f"{value:.2f}", ha="center", va="bottom", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3})  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    ax.legend(seen.values(), seen.keys(), fontsize=8, frameon=False, loc="upper left")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", zorder=0)
    ax.set_xticks(range(len(variants)), [SHORT[v] for v in variants])
    ax.tick_params(axis="x", labelsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel("step time / bf16 step (lower is faster)", fontsize=9)
    ax.set_title("Wide LM (4 layers, width 4096): train step per fp8 recipe", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)
