"""The docs' plots (matplotlib): ratios to the anchor, memory per device, memory/time frontier."""

from __future__ import annotations

from pathlib import Path

from benchmarks.names import MODELS, words
from benchmarks.tables_format import GIB, MIB, _with_anchor


def _ratio_labels(ax, values: list[float], clip: float, span: float) -> None:
    """Each bar's value beside the bar's far end, outside it: right of a bar above 1, left of
    a bar below 1 (so no label sits on a bar); `>` marks a bar clipped at `clip`."""
    for y, v in enumerate(values):
        end, right = min(v, clip), v >= 1
        text = f"{v:.3g}" + (" >" if v > clip else "")
        ax.text(end + (0.01 if right else -0.01) * span, y, text, va="center",
                ha="left" if right else "right", fontsize=7)  # fmt: skip


def plot_ratios(records: list[dict], path: Path, clip: float = 1.5) -> None:
    """Roofline and temp memory of each path over the hand-written bf16 anchor, per model:
    bars from 1 (the anchor), red where worse by more than 1 %, clipped at `clip`; each
    column's axis reaches every bar and its label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    paired = [(r, a) for r, a in _with_anchor(records) if a and r["variant"] != r["anchor"]]
    fig, axes = plt.subplots(
        len(models), 2, figsize=(7.6, 1.2 + 0.3 * len(paired)), squeeze=False,
        sharex="col", sharey="row",
    )  # fmt: skip
    keys = (("roofline_s", "roofline"), ("temp_bytes", "temp memory"))
    for col, (key, _) in enumerate(keys):
        values = [r["figures"][key] / a[key] for r, a in paired]
        low = min([0.95, *values])
        span = clip - low
        axes[0][col].set_xlim(low - 0.24 * span, clip + 0.24 * span)  # room for labels
        for row, model in enumerate(models):
            mine = [(r, a) for r, a in paired if r["model"] == model]
            ratios = [r["figures"][key] / a[key] for r, a in mine]
            ax = axes[row][col]
            colors = ["#c44e52" if v > 1.01 else "#4c72b0" for v in ratios]
            ax.barh(range(len(mine)), [min(v, clip) - 1 for v in ratios], left=1.0, color=colors)
            ax.axvline(1.0, color="black", linewidth=1)
            _ratio_labels(ax, ratios, clip, span)
            ax.set_yticks(range(len(mine)), [f"{words(r['variant'])}" for r, _ in mine])
            ax.set_ylim(len(mine) - 0.5, -0.5)
            name = MODELS.get(model, model)
            ax.set_title(f"{name}: {keys[col][1]}", fontsize=9)
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("ratio to hand-written bf16 (lower is better)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=200)  # shown about 760 px wide: sharp, text about 10 px
    plt.close(fig)


def plot_memory(records: list[dict], path: Path) -> None:
    """Training state per device under 8-way FSDP, per mode: params and the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["model"] == "opt-lm"]
    total = max((r["figures"]["state_bytes"] / 8 for r in rows), default=GIB)
    unit, name = (GIB, "GiB") if total >= GIB / 4 else (MIB, "MiB")
    labels = [r.get("label", r["variant"]) for r in rows]
    params = [r["figures"]["param_bytes"] / 8 / unit for r in rows]
    rest = [(r["figures"]["state_bytes"] - r["figures"]["param_bytes"]) / 8 / unit for r in rows]
    fig, ax = plt.subplots(figsize=(7.6, 1.2 + 0.35 * len(rows)))
    ax.barh(labels, params, color="#4c72b0", label="params")
    ax.barh(labels, rest, left=params, color="#dd8452", label="master + optimizer state")
    for y, (p, q, r) in enumerate(zip(params, rest, rows, strict=True)):
        per = r["figures"]["state_bytes"] / r["figures"]["params"]
        ax.text(p + q, y, f" {p + q:.3g} {name} ({per:.0f} B/param)", va="center", fontsize=8)
    ax.invert_yaxis()
    n = rows[0]["figures"]["params"] / 1e6 if rows else 0
    # two lines: one is wider than the axes beside the long row names, and was cut
    ax.set_xlabel(f"{name} per device\n(the state of a {n:.0f} M-param LM split 8 ways, FSDP)")
    # room right of the longest bar for its label
    ax.set_xlim(0, 1.6 * max((p + q for p, q in zip(params, rest, strict=True)), default=1))
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)


def plot_frontier(records: list[dict], path: Path) -> None:
    """Per-GPU memory (temp + args) against roofline step time (compute and memory kernels,
    collectives left out) of every `memory-switches` row, hand-written and mpjax's, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records[0]["figures"]["details"] if "roofline_s" in r]
    fig, ax = plt.subplots(figsize=(10, 6.5))
    labels: dict[tuple, list[str]] = {}  # points at the same place share one label
    for hand, color, marker, label in ((True, "#c44e52", "s", "hand-written"),
                                       (False, "#4c72b0", "o", "mpjax")):  # fmt: skip
        mine = [r for r in rows if r["hand_written"] == hand]
        xs = [1e3 * r.get("roofline_s_no_collectives", r["roofline_s"]) for r in mine]
        ys = [(r["temp_bytes"] + r["argument_bytes"]) / GIB for r in mine]
        ax.scatter(xs, ys, color=color, marker=marker, label=label, zorder=3)
        for x, y, r in zip(xs, ys, mine, strict=True):
            labels.setdefault((round(x, 1), round(y, 1)), []).append(
                r["row"].removeprefix("anchor: ")
            )
    for (x, y), names in labels.items():
        ax.annotate("; ".join(names), (x, y), xytext=(4, 3), textcoords="offset points",
                    fontsize=7)  # fmt: skip
    if labels:
        low, high = min(x for x, _ in labels), max(x for x, _ in labels)
        ax.set_xlim(low - 0.05 * (high - low), high + 0.45 * (high - low))
    ax.set_xlabel("roofline step time without collectives, ms (H100 peaks)")
    ax.set_ylabel("GiB per GPU (XLA temp + arguments)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    cfg = records[0]["figures"].get("config", {})
    ax.set_title(f"GPT-2-small FSDP step on 8 deviceless H100s (sizes {cfg.get('d', '?')} wide, "
                 f"{cfg.get('layers', '?')} layers): memory against time", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
