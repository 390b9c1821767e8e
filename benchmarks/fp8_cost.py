"""fp8 on the GPU cost model: LM train steps with fp8 GEMMs, compiled for H100 (deviceless).

Variants of the LM of `benchmarks/train_models.py` (`--width gpt2|wide`), each against the
hand-written Flax bf16 step (`bf16`), all with DEFAULT compile options:

- `fp8-tensorwise` / `fp8-rowwise`: `mpjax.autocast(model.apply, ONE_STRING,
  fp8=Fp8Recipe(scaling=..., exclude=("*/head",)))` (the LM head stays bf16, as usual);
- `flax-fp8`: Flax `fp8_ops.Fp8DotGeneralOp` (delayed scaling, quantise-dequantise form) in
  every block GEMM; `flax-fp8-direct`: `Fp8DirectDotGeneralOp` (fp8 operands into the dot).
  Their `_overwrite_with_gradient` variables are replaced by their gradients each step;
- `fp8-delayed`: `mpjax.apply_policy(model, RULES, fp8=Fp8Recipe(scaling="delayed",
  exclude=("*/head",)))` (RULES: bf16 between the modules, float32 logits, as the
  hand-written bf16 model), the `"fp8_meta"` collection updated in the step by
  `mpjax.fp8.update_fp8_meta`.

Reported per variant: roofline and its ratio to bf16, temp memory, the GEMM FLOPs by operand
dtype, and the share of the block GEMMs' FLOPs (QKV, attention output, MLP up/down;
forward and both backward, counted analytically) that run with fp8 operands.

    JAX_PLATFORMS=cpu <gpu-aot python> benchmarks/fp8_cost.py [--width gpt2|wide|all]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

import mpjax  # noqa: E402
from benchmarks import gpu_cost_model as gcm  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from benchmarks.train_variants import (  # noqa: E402
    LM_VARIANTS,
    ONE_STRING,
    RULES,
    TrainProgram,
    _lm,
    lm_program,
)

REQUIRES_GPU = False
OWG = fp8_ops.OVERWRITE_WITH_GRADIENT


def _autocast_fp8(scaling):
    def build(cfg):
        model = _lm(cfg)
        recipe = mpjax.Fp8Recipe(scaling=scaling, exclude=("*/head",))
        return lm_program(cfg, mpjax.autocast(model.apply, ONE_STRING, fp8=recipe), model)

    return build


def _overwrite() -> optax.GradientTransformation:
    """Updates that make `param + update` the gradient (Flax's overwrite-with-gradient)."""

    def update(grads, state, params):
        return jax.tree.map(lambda g, p: g - p, grads, params), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


class _Nested:
    """`init` returning {"params": {"params": ..., OWG: ...}}, as `lm_program` expects."""

    def __init__(self, model):
        self.model = model

    def init(self, key, *args):
        return {"params": dict(self.model.init(key, *args))}


def _flax_fp8(dot_cls):
    def build(cfg):
        model = _lm(cfg, dtype=jnp.bfloat16, dot_general_cls=dot_cls)
        adamw = optax.adamw(3e-4, b2=0.95, weight_decay=0.1)
        tx = optax.multi_transform(
            {"adamw": adamw, "owg": _overwrite()},
            lambda tree: {
                k: jax.tree.map(lambda _, k=k: "owg" if k == OWG else "adamw", v)
                for k, v in tree.items()
            },
        )
        return lm_program(cfg, lambda v, *a: model.apply(v["params"], *a), _Nested(model), tx=tx)

    return build


def _mpjax_delayed(cfg):
    """`apply_policy(..., fp8=delayed)`: fp8 meta in the state, updated inside the step."""
    recipe = mpjax.Fp8Recipe(scaling="delayed", exclude=("*/head",))
    model = mpjax.apply_policy(_lm(cfg), dict(RULES), fp8=recipe)
    tx = optax.adamw(3e-4, b2=0.95, weight_decay=0.1)
    base = lm_program(cfg, model.apply, model, tx=tx)

    def init(key):
        tokens = jnp.zeros((cfg["batch"], cfg["seq"]), jnp.int32)
        variables = model.init(key, tokens, tokens > 0)
        return variables["params"], variables["fp8_meta"], tx.init(variables["params"])

    def step(state, batch):
        params, meta, opt_state = state
        tokens, padding = batch

        def loss_fn(p, m):
            variables = {"params": p, "fp8_meta": m}
            logits = model.apply(variables, tokens[:, :-1], padding).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return jnp.sum(ce * padding) / jnp.maximum(jnp.sum(padding), 1)

        loss, (grads, meta_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta)
        updates, opt_state = tx.update(grads, opt_state, params)
        meta = mpjax.fp8.update_fp8_meta(meta, meta_grads, recipe)
        return (optax.apply_updates(params, updates), meta, opt_state), loss

    return TrainProgram(init, base.batch, step, base.items)


FP8_VARIANTS = MappingProxyType(
    {
        "bf16": LM_VARIANTS["bf16"],
        "fp8-tensorwise": _autocast_fp8("tensorwise"),
        "fp8-rowwise": _autocast_fp8("rowwise"),
        "flax-fp8": _flax_fp8(fp8_ops.Fp8DotGeneralOp),
        "flax-fp8-direct": _flax_fp8(fp8_ops.Fp8DirectDotGeneralOp),
        "fp8-delayed": _mpjax_delayed,
    }
)


def block_gemm_flops(cfg: dict) -> float:
    """FLOPs of the block GEMMs (QKV, out, MLP up/down), forward + both backward."""
    tokens, d = cfg["batch"] * cfg["seq"], cfg["d"]
    per_layer = d * 3 * d + d * d + 2 * d * cfg["mlp"]
    return 3 * 2 * tokens * cfg["layers"] * per_layer


def fp8_rows(records: list[dict]) -> list[list]:
    """Table rows: each record against the bf16 record of its width."""
    anchors = {r["width"]: r for r in records if r["variant"] == "bf16"}
    rows = []
    for r in records:
        fp8 = sum(v for k, v in r["gemm_flops"].items() if "f8" in k)
        anchor = anchors.get(r["width"])
        rows.append(
            [
                r["width"],
                r["variant"],
                round(r["roofline_s"] * 1e3, 3),
                round(r["roofline_s"] / anchor["roofline_s"], 3) if anchor else "-",
                round(r["temp_bytes"] / gcm.GIB, 3),
                round(fp8 / 1e12, 3),
                f"{100 * fp8 / block_gemm_flops(r['config']):.1f} %",
                gcm._tflop(r["gemm_flops"]),
                r["kernels"],
            ]
        )
    return rows


def measure(widths, variants, quick: bool) -> dict:
    """The benchmark result for LM `widths` ("gpt2", "wide") and `variants`."""
    registry = {"lm": FP8_VARIANTS}
    records = []
    for width in ("quick",) if quick else widths:
        for r in gcm.measure_all(("lm",), variants, quick, width, registry):
            records.append({**r, "width": width})
    return {
        "title": "fp8 LM train step, H100 compile (deviceless), default flags, vs Flax bf16",
        "columns": [
            "width",
            "variant",
            "roofline ms",
            "vs bf16",
            "temp GiB",
            "fp8 GEMM TFLOP",
            "block GEMMs in fp8",
            "GEMM TFLOP by dtype",
            "kernels",
        ],
        "rows": fp8_rows(records),
        "notes": f"jax {jax.__version__}; configs "
        + "; ".join(f"{r['width']}: {json.dumps(r['config'])}" for r in records[:: len(variants)])
        + ". Roofline and FLOP accounting of benchmarks/gpu_cost_model.py; block GEMM FLOPs "
        "counted analytically (3 GEMMs x 2 x tokens x layers x (4 d^2 + 2 d mlp)).",
        "details": records,
    }


def run(quick: bool = False) -> dict:
    """Both LM widths, every fp8 variant (the `benchmarks/run.py` entry)."""
    if not gcm.plugin_available():
        return gcm.delegate_to_gpu_aot(Path(__file__), quick)
    return measure(("gpt2", "wide"), list(FP8_VARIANTS), quick)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--width", default="all", choices=("gpt2", "wide", "all"), help="LM size")
    parser.add_argument("--variants", default="", help="comma-separated variant names")
    parser.add_argument("--json", default=None, help="write the full figures to this file")
    args = parser.parse_args(argv)
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()] or list(FP8_VARIANTS)
    unknown = sorted(set(wanted) - set(FP8_VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known {sorted(FP8_VARIANTS)}")
    widths = ("gpt2", "wide") if args.width == "all" else (args.width,)
    result = measure(widths, wanted, args.quick)
    return emit(result, args.json)


if __name__ == "__main__":
    main()
