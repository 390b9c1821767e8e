"""The docs' tables and plots, from the suite's results file (no jax; matplotlib for plots).

`write_docs(results_json, out_dir)` writes, into `out_dir` (`docs/_generated/`, run by
`docs/conf.py` at every build): one Markdown file per table in a short form (`<table>.md`,
the columns a reader compares) and in full (`<table>_full.md`), the run's provenance
(`machine.md`) and two plots: `perf_ratios.png` (roofline and temp memory of every mpjax
path over the hand-written anchor, per model) and `memory_per_device.png` (training state per
device under 8-way FSDP, per mode). A table of a registered case is found by its table name;
a study's own table is written as it returned it.

    python benchmarks/tables.py benchmarks/results.json docs/_generated
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB, MIB = 2**30, 2**20

# --- formatting ------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """A table cell: floats to 4 significant digits, `|` escaped, None empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
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
        short.append([r["model"], r["variant"], roof, temp, _f32(f), f["convert_kernels"]])
        full.append(
            [r["model"], r["variant"], round(f["temp_bytes"] / GIB, 3), temp]
            + [round(f["roofline_s"] * 1e3, 3), roof, round(f["bytes"] / 1e9, 2), f["kernels"]]
            + [kinds, _tflop(f["gemm_flops"]), _tflop(f["conv_flops"]), _f32(f)]
            + [f["converts"], f["convert_kernels"]]
        )
    s_cols = ["model", "path", "roofline vs bf16", "temp vs bf16", "f32 GEMMs/convs"]
    f_cols = ["model", "variant", "temp GiB", "temp vs anchor", "roofline ms"]
    f_cols += ["roofline vs anchor", "GB accessed", "kernels", "kernels by kind"]
    f_cols += ["GEMM TFLOP by dtype", "conv TFLOP by dtype", "f32 GEMMs/convs", "converts"]
    return s_cols + ["convert kernels"], short, f_cols + ["convert kernels"], full


def fp8_table(records):
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        conv = r["model"] == "resnet"
        flops = _matmul_flops(f) if conv else f["gemm_flops"]
        total = sum(flops.values()) if conv else _block_gemm_flops(f["config"])
        share, roof = _fp8_share(flops, total), _ratio(f["roofline_s"], a and a["roofline_s"])
        short.append([_size(r), r["variant"], roof, share])
        full.append(
            [_size(r), r["variant"], round(f["roofline_s"] * 1e3, 3), roof]
            + [round(f["temp_bytes"] / GIB, 3), share, _tflop(f["gemm_flops"])]
            + [_tflop(f["conv_flops"]), f["kernels"]]
        )
    f_cols = ["size", "variant", "roofline ms", "vs anchor", "temp GiB", "in fp8"]
    f_cols += ["GEMM TFLOP by dtype", "conv TFLOP by dtype", "kernels"]
    return ["size", "path", "roofline vs anchor", "in fp8"], short, f_cols, full


def blocks_table(records):
    """The block-scaled recipes against bf16 on their GPU (deviceless H100 and B200)."""
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        share = _fp8_share(f["gemm_flops"], _block_gemm_flops(f["config"]))
        roof = _ratio(f["roofline_s"], a and a["roofline_s"])
        gpu = r["target"].upper()
        short.append([gpu, _size(r), r["variant"], roof, share])
        full.append(
            [gpu, _size(r), r["variant"], round(f["roofline_s"] * 1e3, 3), roof]
            + [round(f["temp_bytes"] / GIB, 3), share, _tflop(f["gemm_flops"])]
            + [", ".join(f"{k} {n}" for k, n in sorted(f["kernels_by_kind"].items()))]
        )
    s_cols = ["GPU", "size", "path", "roofline vs bf16", "block GEMMs in fp8/fp4"]
    f_cols = ["GPU", "size", "variant", "roofline ms", "vs bf16", "temp GiB"]
    f_cols += ["block GEMMs in fp8/fp4", "GEMM TFLOP by dtype", "kernels by kind"]
    return s_cols, short, f_cols, full


def multi_gpu_table(records):
    short, full = [], []
    for r, a in _with_anchor(records):
        f = r["figures"]
        moved = _ratio(f["collective_bytes"], a and a["collective_bytes"])
        per_dev = round((f["temp_bytes"] + f["argument_bytes"]) / MIB, 1)
        short.append([r["model"], r["target"], r["variant"], moved])
        short[-1] += [round(f["comm_s_links"] * 1e3, 3), per_dev]
        ops = "; ".join(
            f"{k} {v['count']}x {v['bytes'] / MIB:.2f}" for k, v in f["by_op_dtype"].items()
        )
        full.append(
            [r["model"], r["target"], f["mesh"], r["variant"], f["collectives"]]
            + [round(f["collective_bytes"] / MIB, 2), moved]
            + [round(f[k] * 1e3, 3) for k in ("comm_s_nvlink", "comm_s_inter_host")]
            + [round(f["comm_s_links"] * 1e3, 3), round(f["temp_bytes"] / MIB, 1)]
            + [round(f["argument_bytes"] / MIB, 1), round(f["state_bytes"] / f["params"], 3)]
            + [ops]
        )
    s_cols = ["model", "target", "path", "collective bytes vs bf16", "comm ms by link"]
    f_cols = ["model", "target", "mesh", "variant", "collectives", "collective MiB"]
    f_cols += ["vs anchor", "comm ms NVLink", "comm ms inter-host", "comm ms by link"]
    f_cols += ["temp MiB/dev", "args MiB/dev", "state B/param", "by op and dtype (count, MiB)"]
    return s_cols + ["MiB per device"], short, f_cols, full


def opt_step_table(records):
    rows = []
    for r, a in _with_anchor(records):
        f = r["figures"]
        rows.append([r["model"], r["variant"], f["kernels"], round(f["bytes"] / 1e6, 2)])
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


def study_table(records):
    """A study's own table (title, columns, rows, notes as its measure returned them)."""
    f = records[0]["figures"]
    return f["columns"], f["rows"], f["columns"], f["rows"]


def time_table(records):
    """Step time on this host against the anchor's, timed in alternating rounds."""
    rows = []
    for r, _ in _with_anchor(records):
        f = r["figures"]
        t, ratio = f["time_s"], f["time_vs_anchor"]
        rows.append([_size(r), r["variant"], round(f["items"] / t["median"])])
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
            parts.append(f"for seed {i}, {losses} and {n} master element(s) apart")
    return text + "; ".join(parts) + " (see below)."


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


def plot_ratios(records: list[dict], path: Path, clip: float = 1.5) -> None:
    """Roofline and temp memory of each path over the hand-written bf16 anchor, per model:
    bars from 1 (the anchor), red where worse by more than 1 %, clipped at `clip`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    paired = [(r, a) for r, a in _with_anchor(records) if a and r["variant"] != r["anchor"]]
    fig, axes = plt.subplots(
        len(models), 2, figsize=(10, 1.0 + 0.3 * len(paired)), squeeze=False, sharex=True
    )
    low = min([0.9] + [r["figures"][k] / a[k] for r, a in paired for k in ("roofline_s",)])
    for row, model in enumerate(models):
        mine = [(r, a) for r, a in paired if r["model"] == model]
        names = [r["variant"] for r, _ in mine]
        for col, (key, what) in enumerate((("roofline_s", "roofline"), ("temp_bytes", "temp"))):
            ax = axes[row][col]
            values = [r["figures"][key] / a[key] for r, a in mine]
            shown = [min(v, clip) - 1 for v in values]
            colors = ["#c44e52" if v > 1.01 else "#4c72b0" for v in values]
            ax.barh(names, shown, left=1.0, color=colors)
            ax.axvline(1.0, color="black", linewidth=1)
            ax.invert_yaxis()
            ax.set_title(f"{model}: {what} / hand-written bf16", fontsize=10)
            for y, v in enumerate(values):
                ax.text(min(v, clip), y, f" {v:.3g}" + (" >" if v > clip else ""), va="center",
                        fontsize=8)  # fmt: skip
            ax.set_xlim(min(low, 0.9) - 0.02, clip + 0.12)
            ax.tick_params(labelsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("ratio to the anchor (1 = the same, lower is better)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.4 * len(rows)))
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


def _not_run(results: dict, table: str) -> str:
    others = [r for r in results["records"] if r["table"] == table and r["status"] != "ok"]
    if not others:
        return "Not measured in this run.\n"
    reasons = sorted({r.get("reason", r["status"]).splitlines()[0] for r in others})
    return f"Not measured in this run ({cell('; '.join(reasons))}).\n"


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
        elif special:
            out.update(special(records))
        else:
            build = TABLES.get(table, study_table)
            s_cols, s_rows, f_cols, f_rows = build(records)
            f = records[0]["figures"] if build is study_table else {}
            title, notes = f.get("title", ""), f.get("notes", "")
            out[table] = markdown_table(s_cols, s_rows) + "\n"
            full = (f"**{cell(title)}**\n\n" if title else "") + markdown_table(f_cols, f_rows)
            out[f"{table}_full"] = full + (f"\n\n{cell(notes)}" if notes else "") + "\n"
    return out


def with_gpu_records(results: dict, gpu_json: Path | None) -> dict:
    """`results` with its real-GPU records replaced by those of `gpu_json` (the file
    `benchmarks/gpu.py` writes on a GPU), when that file exists."""
    if gpu_json is None or not Path(gpu_json).exists():
        return results
    gpu = json.loads(Path(gpu_json).read_text())["records"]
    names = {r["name"] for r in gpu}
    return {**results, "records": [r for r in results["records"] if r["name"] not in names] + gpu}


def write_docs(results_json: Path, out_dir: Path, gpu_json: Path | None = None) -> list[Path]:
    """Writes the pages and plots of `results_json` (its real-GPU records from `gpu_json`)
    into `out_dir`; returns the paths."""
    results = with_gpu_records(json.loads(Path(results_json).read_text()), gpu_json)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in pages(results).items():
        path = out_dir / f"{name}.md"
        if not path.exists() or path.read_text() != text:  # keep mtimes: no needless rebuilds
            path.write_text(text)
        paths.append(path)
    for name, plot, table in (
        ("perf_ratios.png", plot_ratios, "cost"),
        ("memory_per_device.png", plot_memory, "memory"),
    ):
        if records := _ok(results, table):
            plot(records, out_dir / name)
            paths.append(out_dir / name)
    return paths


if __name__ == "__main__":
    for p in write_docs(Path(sys.argv[1]), Path(sys.argv[2]), *map(Path, sys.argv[3:4])):
        print(p)
