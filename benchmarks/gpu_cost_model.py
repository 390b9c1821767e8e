"""GPU cost model: full train steps compiled for an H100 without a device, read from the HLO.

For each model (ResNet-50 and a GPT-2-small-like LM, `benchmarks/train_models.py`) and each
precision variant (`benchmarks/train_variants.py`), the jitted train step (state donated) is
compiled deviceless for `mpjax/_src/analysis/h100.txtpb` and its optimized HLO is read by
`benchmarks/hlo_cost.py`: temp memory (XLA's buffer assignment, `memory_analysis()`), kernels
by kind, GEMM and convolution FLOPs by operand dtype, converts, bytes accessed and a crude
roofline (per kernel max(FLOPs / peak, bytes / HBM bandwidth), summed; H100 SXM peaks in
`hlo_cost.py`), each against the hand-written Flax bf16 anchor (`bf16`). Each record also
carries what `mpjax.report` says of the same compile (`report`: FLOPs by dtype run and asked
for, float32 modules, its summary line; tests/report/test_report_gpu.py checks they agree).

Needs the `gpu-aot` extra (the `jax-cuda12-plugin` and `jax-cuda12-pjrt` wheels of the pinned
jaxlib, installed with `--no-deps` in a separate environment) and no GPU:

    JAX_PLATFORMS=cpu <gpu-aot python> benchmarks/gpu_cost_model.py --model lm --quick

When the plugin is missing here, `run()` (the `benchmarks/run.py` entry) runs this script with
the python named by the `MPJAX_GPU_AOT_PYTHON` environment variable, or reports itself
skipped. Options: `--model resnet|lm|all`, `--variants a,b,...`, `--width gpt2|wide` (LM
size), `--quick` (small sizes, seconds per variant), `--json PATH` (the full figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchmarks.common import Skip, emit  # noqa: E402
from benchmarks.train_models import LM_SIZES, RESNET_SIZES, VOCAB  # noqa: E402
from benchmarks.train_variants import VARIANTS  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.target import (  # noqa: E402,F401
    H100_TARGET,
    compile_step,
    h100_sharding,
    lower_step,
)
from mpjax._src.report.build import build_report  # noqa: E402

REQUIRES_GPU = False  # compiles for a GPU; runs without one
TIMEOUT_SCALE = 4  # 16 compiles of full train steps: ~10 min on 2 cores (benchmarks/run.py)
TARGET = H100_TARGET
ENV_PYTHON = "MPJAX_GPU_AOT_PYTHON"
ANCHOR = "bf16"
GIB = 2**30
TITLE = "GPU cost model: train steps compiled for H100 (deviceless), vs hand-written Flax bf16"
COLUMNS = [
    "model",
    "variant",
    "temp GiB",
    "temp vs anchor",
    "roofline ms",
    "roofline vs anchor",
    "GB accessed",
    "kernels",
    "kernels by kind",
    "GEMM TFLOP by dtype",
    "conv TFLOP by dtype",
    "f32 GEMMs/convs",
    "converts",
    "convert kernels",
]


def program_config(model: str, quick: bool, width: str = "gpt2") -> dict:
    """The size entry of `model` (`"resnet"` or `"lm"`) for a run."""
    if model == "resnet":
        return dict(RESNET_SIZES["quick" if quick else "full"])
    if model == "lm":
        cfg = dict(LM_SIZES["quick" if quick else width])
        cfg["vocab"] = VOCAB["quick" if quick else "full"]
        return cfg
    raise ValueError(f"unknown model {model!r}; expected 'resnet' or 'lm'")


def measure(compiled) -> dict:
    """The cost-model figures of one compiled executable."""
    report = hlo_cost.analyze(compiled.as_text())
    memory = compiled.memory_analysis()
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "roofline_s": report.roofline_s,
        "bytes": report.bytes,
        "kernels": len(report.kernels),
        "kernels_by_kind": report.kernels_by_kind,
        "gemm_flops": report.gemm_flops,
        "conv_flops": report.conv_flops,
        "gemms_by_dtype": report.gemms_by_dtype,
        "convs_by_dtype": report.convs_by_dtype,
        "converts": report.converts,
        "convert_kernels": report.convert_kernels,
    }


def measure_variant(model: str, variant: str, cfg: dict, sharding, variants=None) -> dict:
    """Compiles one variant's train step and returns its figures."""
    table = (variants or VARIANTS)[model]
    if variant not in table:
        raise ValueError(f"unknown {model} variant {variant!r}; known: {sorted(table)}")
    program = table[variant](cfg)
    key = jax.random.key(0)
    state = jax.eval_shape(program.init, key)
    batch = jax.eval_shape(program.batch, key)
    lowered = lower_step(program.step, (state, batch), sharding)
    compiled = lowered.compile()
    report = build_report(lowered, compiled, "h100", True)
    return {**measure(compiled), "report": report_figures(report)}


def report_figures(report) -> dict:
    """What `mpjax.report` says of a step: FLOPs by dtype run, float32 modules, summary."""
    return {
        "flops_by_dtype": report.flops_by_dtype(runs=True),
        "asked_flops_by_dtype": report.flops_by_dtype(runs=False),
        "unmatched_gemms": sum(g.runs_as is None for g in report.gemms),
        "float32_modules": sorted({g.path for g in report.gemms if g.flagged}),
        "convert_kernels": sum(c.kernels for c in report.converts),
        "summary": report.summary(),
    }


def _tflop(flops: dict) -> str:
    return ", ".join(f"{k} {v / 1e12:.3g}" for k, v in sorted(flops.items())) or "-"


def _f32_matmuls(m: dict) -> str:
    return f"{m['gemms_by_dtype'].get('f32', 0)}/{m['convs_by_dtype'].get('f32', 0)}"


def _ratio(r: dict, anchor: dict | None, key: str):
    return round(r[key] / anchor[key], 3) if anchor and anchor[key] else "-"


def table_rows(results: list[dict]) -> list[list]:
    """Rows of the markdown/text table from `measure_all` records."""
    anchors = {r["model"]: r for r in results if r["variant"] == ANCHOR}
    rows = []
    for r in results:
        a = anchors.get(r["model"])
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["kernels_by_kind"].items()))
        rows.append(
            [
                r["model"],
                r["variant"],
                round(r["temp_bytes"] / GIB, 3),
                _ratio(r, a, "temp_bytes"),
                round(r["roofline_s"] * 1e3, 3),
                _ratio(r, a, "roofline_s"),
                round(r["bytes"] / 1e9, 2),
                r["kernels"],
                kinds,
                _tflop(r["gemm_flops"]),
                _tflop(r["conv_flops"]),
                _f32_matmuls(r),
                r["converts"],
                r["convert_kernels"],
            ]
        )
    return rows


def measure_all(models, variants, quick: bool, width: str = "gpt2", registry=None) -> list:
    """Records for each (model, variant); `variants=None` means all of the model's."""
    sharding = h100_sharding()
    registry = registry or VARIANTS
    results = []
    for model in models:
        cfg = program_config(model, quick, width)
        names = [v for v in (variants or registry[model]) if v in registry[model]]
        for name in names:
            figures = measure_variant(model, name, cfg, sharding, registry)
            results.append({"model": model, "variant": name, "config": cfg, **figures})
            print(f"[cost model] {model} {name}: {figures['report']['summary']}", flush=True)
    return results


def result_dict(results: list, quick: bool, width: str = "gpt2") -> dict:
    """The benchmark result (title, columns, rows, notes) plus the records under `details`."""
    sizes = "; ".join(
        f"{m}: {json.dumps(next(r['config'] for r in results if r['model'] == m))}"
        for m in dict.fromkeys(r["model"] for r in results)
    )
    return {
        "title": TITLE + (" (quick sizes)" if quick else ""),
        "columns": COLUMNS,
        "rows": table_rows(results),
        "notes": (
            f"jax {jax.__version__}, XLA:GPU for mpjax/_src/analysis/h100.txtpb, default compile "
            "options; "
            f"train step jitted with its state donated. Sizes: {sizes}. Anchor: '{ANCHOR}' "
            "(hand-written Flax dtype=bfloat16, param_dtype=float32). Roofline: per kernel "
            "max(tensor FLOPs / peak(dtype) + other FLOPs / 67 TFLOP/s, bytes / 3.35 TB/s), "
            "summed; peaks bf16/fp16 989, fp8 1979, tf32 494 TFLOP/s (H100 SXM dense). Bytes: "
            "operands + result of each kernel. Temp: XLA's buffer assignment. 'f32 GEMMs/convs': "
            "dots / convolutions with float32 operands. Converts: convert ops in all kernels; "
            "convert kernels: kernels that only convert (materialised casts)."
        ),
        "details": results,
    }


def delegate_to_gpu_aot(script: Path, quick: bool, extra_args: Sequence[str] = ()) -> dict:
    """Runs `script --json [extra_args]` under the gpu-aot python of `$MPJAX_GPU_AOT_PYTHON`.

    Returns the JSON the script wrote.

    Raises:
      Skip: the variable is unset (the benchmark is then reported as not run).
      RuntimeError: the script failed (its stderr tail is in the message).
    """
    python = os.environ.get(ENV_PYTHON)
    if not python:
        raise Skip(
            "deviceless CUDA compilation is unavailable here (no jax CUDA plugin) and "
            f"{ENV_PYTHON} is not set; install the gpu-aot extra in a separate environment "
            "and point the variable at its python"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [python, str(script), "--json", str(out), *extra_args]
        cmd += ["--quick"] if quick else []
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[1]))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{script.name} under {ENV_PYTHON} exited with {proc.returncode}: "
                f"{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def plugin_available() -> bool:
    """Whether jax here can describe the deviceless CUDA target."""
    try:
        h100_sharding()
    except Exception:  # noqa: BLE001 - no plugin, or it cannot describe the target
        return False
    return True


def run(quick: bool = False) -> dict:
    """Both models, every variant (the `benchmarks/run.py` entry)."""
    if not plugin_available():
        return delegate_to_gpu_aot(Path(__file__), quick)
    return result_dict(measure_all(("resnet", "lm"), None, quick), quick)


def main(argv=None) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax picks a backend
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--model", default="all", choices=("resnet", "lm", "all"))
    parser.add_argument("--variants", default="", help="comma-separated variant names")
    parser.add_argument("--width", default="gpt2", choices=("gpt2", "wide"), help="LM size")
    parser.add_argument("--json", default=None, help="write the full figures to this file")
    args = parser.parse_args(argv)
    models = ("resnet", "lm") if args.model == "all" else (args.model,)
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(wanted) - {v for m in models for v in VARIANTS[m]})
    if unknown:
        parser.error(f"--variants: unknown {unknown}")
    try:
        h100_sharding()
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"gpu_cost_model: deviceless CUDA compile unavailable: {e}") from None
    result = result_dict(measure_all(models, wanted or None, args.quick, args.width), args.quick)
    return emit(result, args.json)


if __name__ == "__main__":
    main()
