"""The docs' tables and plots, from the suite's results file (no jax; matplotlib for plots).

`write_docs(results_json, out_dir)` writes, into `out_dir` (`docs/_generated/`, run by
`docs/conf.py` at every build): one Markdown file per table in a short form (`<table>.md`,
the columns a reader compares, rows named in words with the variant id small), in full
(`<table>_full.md`) and folded in a `<details>` block (`<table>_folded.md`); the short table
each of the performance, memory and fp8 pages leads with (`lead_<page>.md`,
`tables_lead.py`); the run's provenance (`machine.md`) and three plots: `perf_ratios.png`
(roofline and temp memory of every mpjax path over the hand-written anchor, per model),
`memory_per_device.png` (training state per device under 8-way FSDP, per mode) and
`fp8_recipes.png` (the wide LM's step under each fp8 recipe, measured and on the cost
models). A table of a registered case is found by its table name; a study's own table is
written as it returned it, byte counts in MiB/GiB. The docs build regenerates all of them;
by hand (the figures land in `docs/_generated/`, git-ignored):

    python benchmarks/tables.py benchmarks/results.json docs/_generated benchmarks/results-gpu.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.names import MODELS, human_bytes, named, number, sizes_in_words, words
from benchmarks.tables_lead import lead_fp8, lead_memory, lead_performance, plot_fp8

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


# --- one builder per table: records -> (short columns, short rows, full columns, full rows) --


def cost_table(records):
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(f["kernels_by_kind"].items()))
        roof, temp = (
            _ratio(f["roofline_s"], a and a["roofline_s"]),
            _ratio(f["temp_bytes"], a and a["temp_bytes"]),
        )
        short.append([MODELS.get(r["model"], r["model"]), named(r["variant"]), roof, temp])
        short[-1] += [_f32(f), f["convert_kernels"]]
        full.append(
            [r["model"], r["variant"], round(f["temp_bytes"] / GIB, 3), temp]
            + [round(f["roofline_s"] * 1e3, 3), roof, round(f["bytes"] / 1e9, 2), f["kernels"]]
            + [kinds, _tflop(f["gemm_flops"]), _tflop(f["conv_flops"]), _f32(f)]
            + [f["converts"], f["convert_kernels"], _compile_cell(f, a)]
        )
    s_cols = ["model", "path", "roofline vs bf16", "temp vs bf16", "f32 GEMMs/convs"]
    f_cols = ["model", "variant", "temp GiB", "temp vs anchor", "roofline ms"]
    f_cols += ["roofline vs anchor", "GB accessed", "kernels", "kernels by kind"]
    f_cols += ["GEMM TFLOP by dtype", "conv TFLOP by dtype", "f32 GEMMs/convs", "converts"]
    f_cols += ["convert kernels", COMPILE]
    return s_cols + ["convert kernels"], short, f_cols, full


def fp8_table(records):
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        conv = r["model"] == "resnet"
        flops = _matmul_flops(f) if conv else f["gemm_flops"]
        total = sum(flops.values()) if conv else _block_gemm_flops(f["config"])
        share, roof = _fp8_share(flops, total), _ratio(f["roofline_s"], a and a["roofline_s"])
        short.append([MODELS.get(_size(r), _size(r)), named(r["variant"]), roof, share])
        full.append(
            [_size(r), r["variant"], round(f["roofline_s"] * 1e3, 3), roof]
            + [round(f["temp_bytes"] / GIB, 3), share, _tflop(f["gemm_flops"])]
            + [_tflop(f["conv_flops"]), f["kernels"], _compile_cell(f, a)]
        )
    f_cols = ["size", "variant", "roofline ms", "vs anchor", "temp GiB", "in fp8"]
    f_cols += ["GEMM TFLOP by dtype", "conv TFLOP by dtype", "kernels", COMPILE]
    return ["size", "path", "roofline vs anchor", "in fp8"], short, f_cols, full


def blocks_table(records):
    """The block-scaled recipes against bf16 on their GPU (deviceless H100 and B200)."""
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        share = _fp8_share(f["gemm_flops"], _block_gemm_flops(f["config"]))
        roof = _ratio(f["roofline_s"], a and a["roofline_s"])
        gpu = r["target"].upper()
        short.append([gpu, MODELS.get(_size(r), _size(r)), named(r["variant"]), roof, share])
        full.append(
            [gpu, _size(r), r["variant"], round(f["roofline_s"] * 1e3, 3), roof]
            + [round(f["temp_bytes"] / GIB, 3), share, _tflop(f["gemm_flops"])]
            + _parts(f)
            + [", ".join(f"{k} {n}" for k, n in sorted(f["kernels_by_kind"].items()))]
            + [_compile_cell(f, a)]
        )
    s_cols = ["GPU", "size", "path", "roofline vs bf16", "block GEMMs in fp8/fp4"]
    f_cols = ["GPU", "size", "variant", "roofline ms", "vs bf16", "temp GiB"]
    f_cols += ["block GEMMs in fp8/fp4", "GEMM TFLOP by dtype"]
    f_cols += [f"{p} ms (%)" for p in PARTS] + ["kernels by kind", COMPILE]
    return s_cols, short, f_cols, full


PARTS = ("low-precision gemms", "other gemms", "quantise", "transpose", "amax", "other")


def _parts(f: dict) -> list[str]:
    """Each part's roofline ms and share of the step (`mpjax/_src/analysis/decomposition.py`)."""
    parts = f.get("roofline_by_part")
    if not parts:
        return ["-"] * len(PARTS)
    total = sum(parts.values())
    return [f"{parts[p] * 1e3:.2f} ({100 * parts[p] / total:.0f} %)" for p in PARTS]


# The multi-GPU rows the performance page leads with (the full table is folded below it).
MULTI_GPU_SHORT = ("lm", "h100x8")


def multi_gpu_table(records):
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        moved = _ratio(f["collective_bytes"], a and a["collective_bytes"])
        if (r["model"], r["target"]) == MULTI_GPU_SHORT:
            short.append([named(r["variant"]), moved, round(f["comm_s_links"] * 1e3, 3)])
            short[-1].append(human_bytes(f["temp_bytes"] + f["argument_bytes"]))
        ops = "; ".join(
            f"{k} {v['count']}x {v['bytes'] / MIB:.2f}" for k, v in f["by_op_dtype"].items()
        )
        full.append(
            [r["model"], r["target"], f["mesh"], r["variant"], f["collectives"]]
            + [round(f["collective_bytes"] / MIB, 2), moved]
            + [round(f[k] * 1e3, 3) for k in ("comm_s_nvlink", "comm_s_inter_host")]
            + [round(f["comm_s_links"] * 1e3, 3), round(f["temp_bytes"] / MIB, 1)]
            + [round(f["argument_bytes"] / MIB, 1), round(f["state_bytes"] / f["params"], 3)]
            + [ops, _compile_cell(f, a)]
        )
    s_cols = ["path (GPT-2 small, FSDP, 8 H100s on one host)", "collective bytes vs bf16"]
    s_cols += ["comm ms by link"]
    f_cols = ["model", "target", "mesh", "variant", "collectives", "collective MiB"]
    f_cols += ["vs anchor", "comm ms NVLink", "comm ms inter-host", "comm ms by link"]
    f_cols += ["temp MiB/dev", "args MiB/dev", "state B/param", "by op and dtype (count, MiB)"]
    return s_cols + ["memory per GPU"], short, f_cols + [COMPILE], full


def opt_step_table(records):
    rows = []
    for r, a in _with_anchor(records):
        f = r["figures"]
        rows.append([r["model"], named(r["variant"]), f["kernels"], round(f["bytes"] / 1e6, 2)])
        rows[-1] += [_ratio(f["bytes"], a and a["bytes"]), round(f["temp_bytes"] / MIB, 2)]
        rows[-1].append(round(f["roofline_s"] * 1e6, 1))
    cols = ["model", "pattern", "kernels", "MB accessed", "bytes vs bare step", "temp MiB"]
    cols.append("roofline us")
    return cols[:5], [r[:5] for r in rows], cols, rows


def memory_tables(records) -> dict[str, str]:
    """The memory guide's three tables: state bytes per param, optimizer step, train step."""
    state, step, train = [], [], []
    for r, a in _with_anchor(records):
        f, label = r["figures"], r.get("label", r["variant"])
        if r["model"] == "opt-lm":
            n = f["params"]
            opt = (f["state_bytes"] - f["param_bytes"]) / n
            state.append([label, round(f["param_bytes"] / n), round(opt)])
            state[-1] += [
                f"**{round(f['state_bytes'] / n)}**",
                round(f["state_bytes"] / 8 / GIB, 3),
            ]
            step.append([label, f"{f['bytes'] / 1e9:.2f} GB", _ratio(f["bytes"], a and a["bytes"])])
            step[-1].append(_ratio(f["roofline_s"], a and a["roofline_s"]))
        else:
            train.append([label, f"{f['roofline_s'] * 1e3:.2f} ms"])
            train[-1] += [_ratio(f["roofline_s"], a and a["roofline_s"])]
            train[-1] += [_ratio(f["bytes"], a and a["bytes"]), f"{f['temp_bytes'] / GIB:.2f} GiB"]
    n = next((r["figures"]["params"] for r in records if r["model"] == "opt-lm"), 0)
    s_cols = ["set-up", "params", "master + optimizer state", "bytes / param"]
    return {
        "memory_state": f"{n / 1e6:.0f} M params.\n\n"
        + markdown_table([*s_cols, "GiB per device, 8-way FSDP"], state),
        "memory_step": markdown_table(
            ["set-up", "bytes accessed", "bytes vs today's", "roofline vs today's"], step
        ),
        "memory_train_step": markdown_table(
            ["set-up", "roofline", "vs today's step", "bytes vs today's", "temp memory"], train
        ),
    }


# A study's short table: the columns a reader compares (names as the study returns them;
# a study without an entry, or whose columns changed, is shown whole).
STUDY_SHORT = {
    "policy-cpu": ("model", "casts/param optimized", "temp ratio", "residual ratio"),
    "autocast-cpu": (
        "model", "variant", "bytes ratio vs flax bf16", "temp ratio vs flax bf16",
        "time ratio vs flax bf16",
    ),
    "inference": ("variant", "latency ratio", "bytes ratio", "variable bytes", "variable ratio"),
    "step-overhead": ("variant", "donated", "bytes ratio", "HLO copies", "time ratio"),
}  # fmt: skip


def _readable_column(name: str, values: list) -> tuple[str, list]:
    """A byte-count column in MiB or GiB (`bytes accessed` -> `accessed (MiB)`), a MiB
    column of 10 GiB or more in GiB; any other column as it is."""
    nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    words = name.split()
    units = {"MiB", "GiB", "MB", "GB", "(MB)", "(GB)", "ratio", "B/param"}
    if nums and len(nums) == len(values) and "bytes" in words and not units & set(words):
        unit, div = ("GiB", GIB) if max(map(abs, nums)) >= 2 * GIB else ("MiB", MIB)
        label = " ".join(w for w in words if w != "bytes") or "size"
        return f"{label} ({unit})", [number(v / div) for v in values]
    if nums and len(nums) == len(values) and "MiB" in words and max(map(abs, nums)) >= 10240:
        return name.replace("MiB", "GiB"), [f"{v / 1024:.2f}" for v in values]
    return name, values


def _readable(columns: list[str], rows: list[list]) -> tuple[list[str], list[list]]:
    cols = list(zip(*rows, strict=True)) if rows else [[] for _ in columns]
    pairs = [_readable_column(c, list(v)) for c, v in zip(columns, cols, strict=True)]
    return [c for c, _ in pairs], [list(r) for r in zip(*(v for _, v in pairs), strict=True)]


def study_table(records):
    """A study's own table (title, columns, rows, notes as its measure returned them), byte
    counts in MiB/GiB; the short form keeps `STUDY_SHORT`'s columns."""
    f = records[0]["figures"]
    columns, rows = _readable(f["columns"], f["rows"])
    keep = STUDY_SHORT.get(records[0]["table"], ())
    if not keep or not set(keep) <= set(f["columns"]):
        return columns, rows, columns, rows
    idx = [f["columns"].index(c) for c in keep]
    return [columns[i] for i in idx], [[r[i] for i in idx] for r in rows], columns, rows


def time_table(records):
    """Step time on this host against the anchor's, timed in alternating rounds."""
    rows = []
    for r, _ in _with_anchor(records):
        f = r["figures"]
        t, ratio = f["time_s"], f["time_vs_anchor"]
        rows.append([MODELS.get(_size(r), _size(r)), named(r["variant"])])
        rows[-1].append(round(f["items"] / t["median"]))
        rows[-1] += [round(ratio["median"], 3), f"{ratio['min']:.3f}-{ratio['max']:.3f}"]
        rows[-1] += [round(t["median"] * 1e3, 2), round(f["bytes"] / 1e9, 3)]
    cols = ["model", "path", "items/s", "time vs anchor", "min-max", "ms/step", "GB accessed"]
    return cols[:5], [r[:5] for r in rows], cols, rows


TABLES: dict[str, Callable] = {
    "gpu": time_table,
    "cost": cost_table,
    "fp8": fp8_table,
    "fp8-conv": fp8_table,
    "blocks": blocks_table,
    "fp8-nnx": fp8_table,
    "multi-gpu": multi_gpu_table,
    "opt-step": opt_step_table,
}


# --- the convergence study (char-LM and digits per state mode) -----------------------------

_STATE_NAMES = {
    "f32": "float32",
    "bf16": "bfloat16, stochastic",
    "bf16-nearest": "bfloat16, nearest",
    "int8": "8-bit (int8 blockwise), nearest",
    "int8-stochastic": "8-bit (int8 blockwise), stochastic",
}
_CHECKS = ("losses", "metric", "masters")
_MASTER_NAMES = {"auto": "float32", "remainder": "int16 remainder"}


def _f(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _signed(value: float, digits: int, unit: str) -> str:
    return "-" if value == 0 else f"{value:+.{digits}f}{unit}"


def _identity_note(check: dict) -> str:
    """What the float32-master and remainder runs had in common, seed by seed."""
    per_seed = check.get("per_seed", [check])
    same = [i for i, c in enumerate(per_seed) if all(c[k] for k in _CHECKS)]
    text = "The runs with a float32 master and with the remainder are "
    if len(same) == len(per_seed):
        return text + (
            "bit for bit identical (every step's loss, the metric and the final float32 "
            f"masters; {_seeds(same)})."
        )
    parts = [f"bit for bit identical for {_seeds(same)}"] if same else []
    for i, c in enumerate(per_seed):
        if i not in same:
            losses = "the same losses" if c["losses"] else "different losses"
            n = c.get("differing_master_elements", "some")
            parts.append(f"seed {i} gave {losses}, {n} master elements apart")
    lead = text if same else "The runs with a float32 master and with the remainder differ: "
    return lead + "; ".join(parts) + " (see below)."


def _seeds(seeds: list[int]) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def char_lm_section(result: dict) -> str:
    """Validation bits/byte of the char-LM per mode, and the remainder's bit-identity check."""
    lm = result["char_lm"]
    rows = []
    for r in lm["rows"]:
        bpb = _f(r["val_bits_per_byte"], 4)
        if lm["seeds"] > 1:
            bpb += f" ± {_f(r['val_bits_per_byte_std'], 4)}"
        master = _MASTER_NAMES[r["master_weights"]] if r["param_dtype"] == "bf16" else "none"
        rows.append(
            [
                "bfloat16" if r["param_dtype"] == "bf16" else "float32",
                master,
                _STATE_NAMES[r["optimizer_state"]],
                _f(r["bytes_per_param"], 2),
                bpb,
                _signed(r["vs_float32_state_pct"], 2, " %"),
            ]
        )
    seeds = "seed 0" if lm["seeds"] == 1 else f"mean ± std over seeds 0-{lm['seeds'] - 1}"
    columns = ["params", "master", "AdamW state", "bytes / param", f"val bits/byte ({seeds})"]
    columns.append("vs float32 state")
    note = f"{lm['steps']} steps. " + _identity_note(lm["bit_identical"])
    return markdown_table(columns, rows) + "\n\n" + note + "\n"


def digits_section(result: dict) -> str:
    """Test accuracy of the digits ResNet per AdamW state dtype."""
    d = result["digits"]
    rows = [
        [
            _STATE_NAMES[r["optimizer_state"]],
            _f(r["bytes_per_param"], 2),
            f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f}",
            _signed(r["vs_float32_state_pp"], 2, " pp"),
        ]
        for r in d["rows"]
    ]
    columns = ["AdamW state", "bytes / param", f"test accuracy % (mean ± std, {d['seeds']} seeds)"]
    columns.append("vs float32 state")
    note = (
        f"{d['steps']} steps, seeds 0-{d['seeds'] - 1} for every mode (the same initialisations "
        f"and batch orders), {d['test_images']} test images "
        f"(one image is {100 / d['test_images']:.2f} pp)."
    )
    return markdown_table(columns, rows) + "\n\n" + note + "\n"


# --- plots -----------------------------------------------------------------------------------


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
    ax.set_xlabel(f"{name} per device: the state of a {n:.0f} M-param LM split 8 ways (FSDP)")
    ax.set_xlim(0, 1.4 * max((p + q for p, q in zip(params, rest, strict=True)), default=1))
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


# --- the pages -------------------------------------------------------------------------------


def machine_section(results: dict) -> str:
    """Where, how and by which command the figures were measured."""
    m = results.get("machine", {})
    quick = (
        " **Quick run: small models (`--quick`), for the structure of the figures; the full "
        "sizes come from `python benchmarks/run.py`.**"
        if results.get("quick")
        else ""
    )
    counts = {}
    for r in results["records"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    status = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return (
        f"Generated by `{results.get('command', '?')}` on {m.get('date', '?')} (finished "
        f"{results.get('finished', '?')}): {status} cases; {m.get('cpu_count', '?')} CPUs, jax "
        f"{m.get('jax', '?')}, jaxlib {m.get('jaxlib', '?')}, Python {m.get('python', '?')}."
        f"{quick}\n"
    )


# What a table shows, for the line that says it was not measured.
NOT_RUN_NAMES = {
    "gpu": "Step times on a real GPU",
    "kernels-gpu": "The Pallas kernels timed on a real GPU",
    "reduce-dtype-h100": "Gradient collectives per reduce dtype on 8 H100s",
}


def _not_run(results: dict, table: str) -> str:
    """One line naming the table and why it is missing (two missing tables never read the
    same)."""
    what = NOT_RUN_NAMES.get(table, f"The `{table}` table")
    others = [r for r in results["records"] if r["table"] == table and r["status"] != "ok"]
    if not others:
        return f"{what}: not measured in this run.\n"
    reasons = sorted({r.get("reason", r["status"]).splitlines()[0] for r in others})
    return f"{what}: not measured in this run ({cell('; '.join(reasons))}).\n"


def folded(summary: str, body: str) -> str:
    """`body` (Markdown) in a `<details>` block that opens on `summary`."""
    return f"<details>\n<summary>{summary}</summary>\n\n{body.strip()}\n\n</details>\n"


# Every table the docs include (a table missing from a run reads "Not measured").
DOC_TABLES = (
    "cost", "fp8", "fp8-conv", "fp8-nnx", "blocks", "blockwise-hopper", "blocks-convergence",
    "multi-gpu", "opt-step",
    "memory", "convergence", "policy-cpu", "autocast-cpu", "step-overhead", "inference",
    "data-parallel", "reduce-dtype", "reduce-dtype-h100", "gpu", "kernels-gpu",
)  # fmt: skip


def _rounded(rows: list[list]) -> list[list]:
    return [[f"{c:.3g}" if isinstance(c, float) else c for c in row] for row in rows]


def _reduce_dtype_pages(records) -> dict[str, str]:
    from benchmarks.training_studies import SUM_COLUMNS, TRAIN_COLUMNS

    f = records[0]["figures"]
    short = markdown_table(SUM_COLUMNS, _rounded(f["sum"])) + "\n"
    train = markdown_table(TRAIN_COLUMNS, _rounded(f["train"]))
    return {"reduce-dtype": short, "reduce-dtype_full": short + "\n" + train + "\n"}


def _convergence_pages(records) -> dict[str, str]:
    f = records[0]["figures"]
    return {"memory_char_lm": char_lm_section(f), "memory_digits": digits_section(f)}


# table -> (pages of its records, the pages it writes)
SPECIAL = {
    "memory": (memory_tables, ("memory_state", "memory_step", "memory_train_step")),
    "reduce-dtype": (_reduce_dtype_pages, ("reduce-dtype", "reduce-dtype_full")),
    "convergence": (_convergence_pages, ("memory_char_lm", "memory_digits")),
}


def pages(results: dict) -> dict[str, str]:
    """name -> Markdown: `<table>` (short) and `<table>_full` for every table of the run."""
    out = {"machine": machine_section(results)}
    tables = dict.fromkeys([*DOC_TABLES, *(r["table"] for r in results["records"])])
    for table in tables:
        records = _ok(results, table)
        special, names = SPECIAL.get(table, (None, (table, f"{table}_full")))
        if not records:
            out.update(dict.fromkeys(names, _not_run(results, table)))
            out[f"{table}_folded"] = ""
        elif special:
            out.update(special(records))
        else:
            build = TABLES.get(table, study_table)
            s_cols, s_rows, f_cols, f_rows = build(records)
            f = records[0]["figures"] if build is study_table else {}
            title, notes = f.get("title", ""), f.get("notes", "")
            caption = f"**{cell(title)}**\n\n" if title else ""
            out[table] = caption + markdown_table(s_cols, s_rows) + "\n"
            full = caption + markdown_table(f_cols, f_rows)
            notes = sizes_in_words(cell(notes)) if notes else ""
            out[f"{table}_full"] = full + (f"\n\n{notes}" if notes else "") + "\n"
            n = len(f_rows)
            out[f"{table}_folded"] = folded(
                f"All {n} rows and {len(f_cols)} columns", out[f"{table}_full"]
            )
    return out


def with_records(results: dict, *paths: Path | None) -> dict:
    """`results` with the records of each results file in `paths` (those that exist) in place
    of its records of the same name: the real-GPU file `benchmarks/gpu.py` writes, and the
    files one `run.py --only ... --json` command wrote for a table re-measured since the
    suite's full run."""
    for path in paths:
        if path is None or not Path(path).exists():
            continue
        newer = json.loads(Path(path).read_text())["records"]
        names = {r["name"] for r in newer}
        results = {**results, "records": [r for r in results["records"] if r["name"] not in names]}
        results["records"] += newer
    return results


def with_gpu_records(results: dict, gpu_json: Path | None) -> dict:
    """`results` with its real-GPU records replaced by those of `gpu_json`."""
    return with_records(results, gpu_json)


# The short table each page leads with: `lead_<page>.md`.
LEADS = {"performance": lead_performance, "memory": lead_memory, "fp8": lead_fp8}


def write_docs(results_json: Path, out_dir: Path, *newer: Path | None) -> list[Path]:
    """Writes the pages and plots of `results_json` (with the records of the `newer` results
    files in place of its own, `with_records`) into `out_dir`; returns the paths."""
    results = with_records(json.loads(Path(results_json).read_text()), *newer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    leads = {f"lead_{name}": fn(results["records"]) for name, fn in LEADS.items()}
    for name, text in {**pages(results), **leads}.items():
        path = out_dir / f"{name}.md"
        if not path.exists() or path.read_text() != text:  # keep mtimes: no needless rebuilds
            path.write_text(text)
        paths.append(path)
    for name, plot, table in (
        ("perf_ratios.png", plot_ratios, "cost"),
        ("memory_per_device.png", plot_memory, "memory"),
        ("memory_frontier.png", plot_frontier, "memory-switches"),
    ):
        if records := _ok(results, table):
            plot(records, out_dir / name)
            paths.append(out_dir / name)
    plot_fp8(results["records"], out_dir / "fp8_recipes.png")
    return paths + [out_dir / "fp8_recipes.png"]


if __name__ == "__main__":
    for p in write_docs(Path(sys.argv[1]), Path(sys.argv[2]), *map(Path, sys.argv[3:])):
        print(p)
