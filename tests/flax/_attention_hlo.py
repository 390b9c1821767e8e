"""Deviceless H100 compiles for tests/flax/test_attention_gpu.py (run under the gpu-aot python).

Writes one JSON object to `--json PATH`: per program, the GEMM FLOPs by operand dtype
(`benchmarks/hlo_cost.py`) of the optimized HLO of one SGD train step of a small attention
model under `apply_policy(model, "params=float32,compute=bfloat16,output=float32")`, with a
padding mask and a causal mask:

- `nnx`: an `nnx.MultiHeadAttention` (Flax's default `attention_fn`, so mpjax's
  `float32_softmax_attention`) between two `nnx.Linear`s;
- `linen`: the same model with `flax.linen.MultiHeadDotProductAttention`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.target import compile_step, h100_sharding  # noqa: E402

B, T, D, HEADS = 8, 128, 256, 4
POLICY = "params=float32,compute=bfloat16,output=float32"


def masks(lengths):
    """Padding mask (keys beyond each row's length) and causal mask, `[B, 1, T, T]`."""
    pad = jnp.arange(T)[None, :] < lengths[:, None]
    return nn.combine_masks(pad[:, None, None, :], nn.make_causal_mask(jnp.ones((B, T))))


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(D, D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, lengths):
        return self.out(self.attn(self.inp(x), mask=masks(lengths)))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x, lengths):
        h = nn.MultiHeadDotProductAttention(HEADS)(nn.Dense(D)(x), mask=masks(lengths))
        return nn.Dense(D)(h)


def gemm_flops(step, *args) -> dict:
    text = compile_step(step, args, h100_sharding(), donate_argnums=()).as_text()
    return hlo_cost.analyze(text).gemm_flops


def nnx_program():
    model = nnx.eval_shape(lambda: mpjax.apply_policy(NnxModel(nnx.Rngs(0)), POLICY))
    graphdef, params = nnx.split(model)

    def step(params, x, lengths):
        def loss(model):
            return jnp.mean(model(x, lengths).astype(jnp.float32) ** 2)

        model = nnx.merge(graphdef, params)
        grads = nnx.grad(loss)(model)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, nnx.state(grads))

    return step, params


def linen_program():
    model = mpjax.apply_policy(LinenModel(), POLICY)
    x = jnp.zeros((B, T, D))
    params = jax.eval_shape(model.init, jax.random.key(0), x, jnp.full((B,), T))

    def step(params, x, lengths):
        def loss(params):
            return jnp.mean(model.apply(params, x, lengths).astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures to this file")
    out = Path(parser.parse_args().json)
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    result = {}
    for name, program in (("nnx", nnx_program), ("linen", linen_program)):
        step, params = program()
        result[name] = {"gemm_flops": gemm_flops(step, params, x, lengths)}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
