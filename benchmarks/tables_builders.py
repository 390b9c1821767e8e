"""One builder per step table (cost, fp8, blocks, multi-GPU, optimizer step, GPU time, memory).

Each returns (short columns, short rows, full columns, full rows); `memory_tables` returns
the memory guide's three tables.
"""

from __future__ import annotations

from benchmarks.names import MODELS, human_bytes, named
from benchmarks.tables_format import (
    COMPILE,
    GIB,
    MIB,
    _block_gemm_flops,
    _compile_cell,
    _f32,
    _fp8_share,
    _matmul_flops,
    _ratio,
    _size,
    _tflop,
    _with_anchor,
    markdown_table,
)

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


def time_table(records):
    """Step time on this host against the anchor's, timed in alternating rounds; where the
    rows carry it (`benchmarks/calibrate.py`), the calibrated model's ratio beside it."""
    rows = []
    pairs = list(_with_anchor(records))
    modelled = any("model_vs_anchor" in r["figures"] for r, _ in pairs)
    for r, _ in pairs:
        f = r["figures"]
        t, ratio = f["time_s"], f["time_vs_anchor"]
        rows.append([MODELS.get(_size(r), _size(r)), named(r["variant"])])
        rows[-1].append(round(f["items"] / t["median"]))
        rows[-1].append(round(ratio["median"], 3))
        if modelled:
            model = f.get("model_vs_anchor")
            rows[-1].append("-" if model is None else round(model, 3))
        rows[-1].append(f"{ratio['min']:.3f}-{ratio['max']:.3f}")
        rows[-1] += [round(t["median"] * 1e3, 2), round(f["bytes"] / 1e9, 3)]
    cols = ["model", "path", "items/s", "time vs anchor"]
    cols += ["calibrated model"] * modelled + ["min-max", "ms/step", "GB accessed"]
    n = 5 + modelled
    return cols[:n], [r[:n] for r in rows], cols, rows
