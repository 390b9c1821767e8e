"""GPU training throughput of mpjax's own precision paths vs hand-written Flax bf16 and fp32.

On a real GPU, with synthetic data already on the device, the train steps of
`benchmarks/train_variants.py` (the same programs the GPU cost model compiles) are timed for
ResNet-50 (224x224x3, batch 128, SGD momentum, BatchNorm) and the GPT-2-small-like LM (seq 1024,
batch 8, AdamW), state donated:

- `fp32`: the float32 model (XLA's default precision: TF32 on Ampere and newer);
- `bf16 hand-written Flax (anchor)`: `dtype=bfloat16, param_dtype=float32`;
- `apply_policy one-string`, `apply_policy per-module`, `autocast`, `fp16 + loss_scaled`, and
  for ResNet `ConvBN (auto)` / `ConvBN (xla)`: mpjax's paths (see `train_variants.py`);
- fp8 (rows `lm-fp8 <width>`, the LM at GPT-2-small width and the wide LM of
  `benchmarks/fp8_variants.py`): `autocast(fp8=Fp8Recipe())` tensorwise and rowwise, delayed
  scaling through `apply_policy`, and Flax's `Fp8DirectDotGeneralOp` / `Fp8DotGeneralOp`,
  each against the same hand-written bf16 anchor (the programs of `fp8_variants.FP8_VARIANTS`).

Beside each measured step time the GPU cost model's prediction for an H100
(the suite's `cost` cases: deviceless compile, crude roofline) is printed, both also as a
ratio to the anchor. Targets on a real GPU: every mpjax path >= 0.99x the anchor's images/s
(tokens/s), and the bf16 speed-up over fp32 at least the anchor's. Throughputs are medians over
interleaved rounds with min-max; ratios are paired per round.

`python benchmarks/gpu.py` runs it (several minutes); `--quick` uses the cost model's quick sizes;
`--smoke` runs tiny models on whatever device jax has (CPU included), only to check the script.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Skip,
    check_result,
    format_text,
    gpu_available,
    paired_ratio,
    summary,
    time_train_steps,
)
from benchmarks.train_models import LM_SIZES, RESNET_SIZES, VOCAB  # noqa: E402
from benchmarks.train_variants import VARIANTS as PROGRAMS  # noqa: E402

REQUIRES_GPU = True
ANCHOR = "bf16 hand-written Flax (anchor)"
# Row label -> variant name in `train_variants.VARIANTS[model]`.
VARIANTS = {
    "fp32": "fp32",
    ANCHOR: "bf16",
    "apply_policy one-string": "policy",
    "apply_policy per-module": "policy-rules",
    "autocast": "autocast",
    "fp16 + loss_scaled": "fp16-scaled",
    "ConvBN (auto)": "convbn",
    "ConvBN (xla)": "convbn-xla",
}
# Row label -> LM variant name (`fp8_variants.FP8_VARIANTS` and the bf16 anchor).
FP8_LABELS = {
    ANCHOR: "bf16",
    "fp8 autocast tensorwise": "fp8-tensorwise",
    "fp8 autocast rowwise": "fp8-rowwise",
    "fp8 delayed (apply_policy)": "fp8-delayed",
    "Flax Fp8DirectDotGeneralOp": "flax-fp8-direct",
    "Flax Fp8DotGeneralOp": "flax-fp8",
}
TIMING = {"full": (5, 10), "quick": (3, 5), "smoke": (2, 2)}  # rounds, steps per round

_MATMUL = re.compile(r"stablehlo\.(?:convolution|dot_general).*->\s*tensor<[^>]*x(\w+)>")
_FP8_MATMUL = re.compile(r"stablehlo\.(?:convolution|dot_general).*\(tensor<[^>]*xf8[^>]*>")


def matmul_dtypes(lowered_text: str) -> dict[str, int]:
    """Result dtype -> count of the convolutions and dot_generals of a lowered program."""
    counts: dict[str, int] = {}
    for line in lowered_text.splitlines():
        match = _MATMUL.search(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def fp8_matmuls(lowered_text: str) -> int:
    """Count of convolutions and dot_generals whose first operand is a float8 tensor."""
    return sum(1 for line in lowered_text.splitlines() if _FP8_MATMUL.search(line))


def configs(size: str) -> dict[str, dict]:
    """Model name -> size config (the cost model's sizes for "full" and "quick")."""
    lm_size = "gpt2" if size == "full" else size
    return {
        "resnet": dict(RESNET_SIZES[size]),
        "lm": {**LM_SIZES[lm_size], "vocab": VOCAB[size]},
    }


def predictions(
    model: str, cfg: dict, names: Sequence[str], registry: dict | None = None
) -> dict[str, float]:
    """Variant -> the cost model's H100 roofline seconds; empty without the CUDA plugin."""
    from benchmarks import harness, run

    if not run.plugin_available():
        return {}
    table = (registry or VARIANTS)[model]
    out = {}
    for name in names:
        compiled = harness.compile_program(table[name](cfg), "h100")[1]
        out[name] = harness.hlo_figures(compiled.as_text())["roofline_s"]
    return out


def measure_model(
    model: str,
    cfg: dict,
    rounds: int,
    steps: int,
    registry: dict | None = None,
    label_map: dict[str, str] = VARIANTS,
    row_name: str | None = None,
) -> list[list]:
    """Times every variant of one model; returns its table rows.

    `registry` maps model -> variant -> program builder (`train_variants.VARIANTS` by
    default); `label_map` maps row labels to its variant names; `row_name` labels the rows.
    """
    registry = registry or PROGRAMS
    labels = {label: name for label, name in label_map.items() if name in registry[model]}
    programs = {label: registry[model][name](cfg) for label, name in labels.items()}
    key_init, key_batch = jax.random.split(jax.random.key(0))
    batch = programs[ANCHOR].batch(key_batch)
    compiled, states, matmuls, fp8 = {}, {}, {}, {}
    for label, program in programs.items():
        states[label] = program.init(key_init)
        lowered = jax.jit(program.step, donate_argnums=0).lower(states[label], batch)
        matmuls[label] = matmul_dtypes(lowered.as_text())
        fp8[label] = fp8_matmuls(lowered.as_text())
        compiled[label] = lowered.compile()
    times, losses = time_train_steps(compiled, states, batch, rounds=rounds, steps_per_round=steps)
    predicted = predictions(
        model, cfg, list(labels.values()), None if registry is PROGRAMS else registry
    )
    items = programs[ANCHOR].items
    rows = []
    for label in programs:
        s = summary([items / t for t in times[label]])
        pred = predicted.get(labels[label], float("nan"))
        pred_anchor = predicted.get("bf16", float("nan"))
        total = sum(matmuls[label].values())
        low = sum(n for k, n in matmuls[label].items() if k in ("bf16", "f16"))
        rows.append(
            [
                row_name or model,
                label,
                s["median"],
                f"{s['min']:.4g}-{s['max']:.4g}",
                paired_ratio(times, "fp32", label)["median"] if "fp32" in times else "-",
                paired_ratio(times, ANCHOR, label)["median"],
                float(np.median(times[label]) * 1e3),
                pred * 1e3,
                pred_anchor / pred,
                f"{low}/{total}",
                fp8[label],
                float(losses[label]),
            ]
        )
    return rows


def run(quick: bool = False, smoke: bool = False) -> dict:
    """Runs the benchmark (a GPU is required unless `smoke`)."""
    if not smoke and not gpu_available():
        raise Skip(f"needs a GPU; jax's platform here is {jax.default_backend()!r}")
    size = "smoke" if smoke else ("quick" if quick else "full")
    rounds, steps = TIMING[size]
    cfgs = configs(size)
    rows = [r for model, cfg in cfgs.items() for r in measure_model(model, cfg, rounds, steps)]
    rows += fp8_rows(size, rounds, steps)
    device = jax.devices()[0]
    notes = [
        f"Sizes: resnet {cfgs['resnet']}; lm {cfgs['lm']}; lm-fp8 rows: "
        f"{'LM_SIZES gpt2 and wide' if size == 'full' else LM_SIZES['quick']}, vocab "
        f"{VOCAB[size]}. Synthetic data on device, state "
        f"donated; {rounds} interleaved rounds of {steps} steps per variant.",
        f"Device: {device.device_kind} ({jax.default_backend()}).",
        "Throughput: images/s (ResNet) or tokens/s (LM). 'x fp32' and 'x anchor': paired "
        "per-round throughput ratios (anchor = hand-written Flax bf16).",
        "Predicted: the GPU cost model's H100 roofline for the same step (deviceless compile; "
        "n/a without the CUDA plugin); 'predicted x anchor' is anchor ms / variant ms, "
        "comparable with 'x anchor'.",
        "'low-precision matmuls': convolutions and dot_generals with a bf16/f16 result in the "
        "lowered program; 'fp8 matmuls': those with float8 operands (on CPU, --smoke, XLA "
        "emulates them).",
        "Targets on a real GPU: every mpjax path >= 0.99x the anchor; bf16 'x fp32' >= the "
        "anchor's.",
    ]
    nonfinite = [f"{r[0]} {r[1]}" for r in rows if not np.isfinite(r[-1])]
    if nonfinite:
        notes.append(f"NON-FINITE LOSS (a bug, not a timing): {', '.join(nonfinite)}.")
    if smoke:
        notes.insert(0, "SMOKE RUN (tiny models; checks the script works, not a measurement).")
    return {
        "title": "GPU training throughput: mpjax paths vs hand-written Flax bf16 and fp32",
        "columns": [
            "model",
            "variant",
            "items/s (median)",
            "items/s min-max",
            "x fp32",
            "x anchor",
            "measured ms",
            "predicted ms (H100 model)",
            "predicted x anchor",
            "low-precision matmuls",
            "fp8 matmuls",
            "last loss",
        ],
        "rows": rows,
        "notes": " ".join(notes),
    }


def fp8_rows(size: str, rounds: int, steps: int) -> list[list]:
    """The fp8 LM rows: GPT-2-small width and the wide LM; the quick LM otherwise (the
    smoke LM's GEMMs are below `Fp8Recipe.min_dim`, so nothing would run in fp8)."""
    from benchmarks.fp8_variants import FP8_VARIANTS
    from benchmarks.train_variants import LM_VARIANTS

    vocab = VOCAB[size]
    widths = ("gpt2", "wide") if size == "full" else ("quick",)
    registry = {"lm": {"bf16": LM_VARIANTS["bf16"], **FP8_VARIANTS}}
    return [
        row
        for width in widths
        for row in measure_model(
            "lm",
            {**LM_SIZES[width], "vocab": vocab},
            rounds,
            steps,
            registry,
            FP8_LABELS,
            row_name=f"lm-fp8 {width}",
        )
    ]


def main(argv: Sequence[str] | None = None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the cost model's quick sizes")
    parser.add_argument("--smoke", action="store_true", help="tiny models on any device")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(quick=args.quick, smoke=args.smoke)
    except Skip as exc:
        raise SystemExit(
            f"gpu.py: skipped: {exc} (use --smoke to check the script on CPU)"
        ) from None
    check_result(result)
    print(format_text(result))
    return result


if __name__ == "__main__":
    main()
