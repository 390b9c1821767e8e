"""fp8 for Flax NNX on the GPU cost model: an NNX LM train step compiled for H100 (deviceless).

The LM sizes of `benchmarks/train_models.py` (`--width gpt2|wide`), written in NNX (pre-LN
blocks of `nnx.MultiHeadAttention`, whose q/k/v/out projections are `nnx.LinearGeneral`, and
an `nnx.Linear` MLP), all with DEFAULT compile options, each variant under
`mpjax.apply_policy(model, RULES)` (bf16 compute, float32 params and logits):

- `nnx-bf16`: the policy alone;
- `nnx-fp8-delayed`: the policy with `fp8=Fp8Recipe(scaling="delayed", exclude=("*/head",))`,
  the `Fp8Meta` state differentiated with the params (`nnx.DiffState`) and updated in the step
  by `mpjax.fp8.update_nnx_fp8_meta`.

Reported: roofline and its ratio to `nnx-bf16`, the GEMM FLOPs by operand dtype, and the share
of the block GEMMs' FLOPs (QKV, attention output, MLP up/down; forward and both backward,
counted analytically) that run with fp8 operands.

    JAX_PLATFORMS=cpu <gpu-aot python> benchmarks/fp8_nnx_cost.py [--width gpt2|wide|all]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mpjax  # noqa: E402
from benchmarks import gpu_cost_model as gcm  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from benchmarks.train_models import LM_SIZES, VOCAB  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax.fp8 import Fp8Meta, update_nnx_fp8_meta  # noqa: E402

REQUIRES_GPU = False  # compiles for a GPU; runs without one
TIMEOUT_SCALE = 2
VARIANTS = ("nnx-bf16", "nnx-fp8-delayed")
RULES = {"*": "params=float32,compute=bfloat16,output=float32"}


class Block(nnx.Module):
    def __init__(self, cfg: dict, rngs: nnx.Rngs):
        d = cfg["d"]
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg["heads"], d, decode=False, rngs=rngs)
        self.up, self.down = (
            nnx.Linear(d, cfg["mlp"], rngs=rngs),
            nnx.Linear(cfg["mlp"], d, rngs=rngs),
        )

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, cfg: dict, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg["vocab"], cfg["d"], rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg["layers"])])
        self.ln = nnx.LayerNorm(cfg["d"], rngs=rngs)
        self.head = nnx.Linear(cfg["d"], cfg["vocab"], rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def program(cfg: dict, fp8: bool):
    """`(step, abstract args)` of one train step on `nnx.split` state (adamw)."""
    recipe = mpjax.Fp8Recipe(scaling="delayed", exclude=("*/head",)) if fp8 else None
    model = nnx.eval_shape(lambda: mpjax.apply_policy(LM(cfg, nnx.Rngs(0)), RULES, fp8=recipe))
    tx = optax.adamw(3e-4, b2=0.95, weight_decay=0.1)
    graphdef, state = nnx.split(model)
    opt_state = jax.eval_shape(tx.init, nnx.state(model, nnx.Param))
    diff = nnx.DiffState(0, (nnx.Param, Fp8Meta))

    def step(carry, tokens):
        state, opt_state = carry
        model = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
        params = nnx.state(model, nnx.Param)
        updates, opt_state = tx.update(nnx.state(grads, nnx.Param), opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        if fp8:
            update_nnx_fp8_meta(model, grads, recipe)
        return (nnx.state(model), opt_state), loss

    tokens = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32)
    return step, ((state, opt_state), tokens)


def measure(widths, quick: bool) -> dict:
    """The benchmark result for LM `widths` ("gpt2", "wide"), both variants."""
    sharding = gcm.h100_sharding()
    rows, details = [], []
    for width in ("quick",) if quick else widths:
        cfg = dict(LM_SIZES[width], vocab=VOCAB["quick" if quick else "full"])
        tokens, d = cfg["batch"] * cfg["seq"], cfg["d"]
        block_flops = 3 * 2 * tokens * cfg["layers"] * (4 * d * d + 2 * d * cfg["mlp"])
        base = None
        for variant in VARIANTS:
            step, args = program(cfg, variant != "nnx-bf16")
            report = hlo_cost.analyze(gcm.compile_step(step, args, sharding).as_text())
            base = base or report.roofline_s
            fp8 = sum(v for k, v in report.gemm_flops.items() if "f8" in k)
            rows.append(
                [
                    width,
                    variant,
                    round(report.roofline_s * 1e3, 3),
                    round(report.roofline_s / base, 3),
                    f"{100 * fp8 / block_flops:.1f} %",
                    gcm._tflop(report.gemm_flops),
                    len(report.kernels),
                ]
            )
            details.append(
                {
                    "width": width,
                    "variant": variant,
                    "config": cfg,
                    "roofline_s": report.roofline_s,
                    "gemm_flops": report.gemm_flops,
                }
            )
    return {
        "title": "fp8 NNX LM train step, H100 compile (deviceless), default flags, vs NNX bf16",
        "columns": [
            "width",
            "variant",
            "roofline ms",
            "vs nnx-bf16",
            "block GEMMs in fp8",
            "GEMM TFLOP by dtype",
            "kernels",
        ],
        "rows": rows,
        "notes": f"jax {jax.__version__}; the NNX LM of this script under apply_policy; roofline "
        "and FLOP accounting of benchmarks/gpu_cost_model.py; block GEMM FLOPs counted "
        "analytically (3 GEMMs x 2 x tokens x layers x (4 d^2 + 2 d mlp)).",
        "details": details,
    }


def run(quick: bool = False) -> dict:
    """Both LM widths (the `benchmarks/run.py` entry)."""
    if not gcm.plugin_available():
        return gcm.delegate_to_gpu_aot(Path(__file__), quick)
    return measure(("gpt2", "wide"), quick)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--width", default="all", choices=("gpt2", "wide", "all"), help="LM size")
    parser.add_argument("--json", default=None, help="write the full figures to this file")
    args = parser.parse_args(argv)
    widths = ("gpt2", "wide") if args.width == "all" else (args.width,)
    result = measure(widths, args.quick)
    return emit(result, args.json)


if __name__ == "__main__":
    main()
