"""Deviceless H100 compiles for tests/flax/test_attention_gpu.py (run under the gpu-aot python).

Writes one JSON object to `--json PATH`: per program, the GEMM FLOPs by operand dtype
(`mpjax/_src/analysis/hlo_cost.py`) and the custom-call targets of the optimized HLO of one
SGD train step of a small attention model with a padding mask and a causal mask:

- `nnx`: an `nnx.MultiHeadAttention` (Flax's default `attention_fn`, so mpjax's fused or
  float32-softmax attention) between two `nnx.Linear`s, under
  `apply_policy(model, "params=float32,compute=bfloat16,output=float32")`;
- `linen`: the same model with `flax.linen.MultiHeadDotProductAttention`;
- `autocast`: the same computation written with `jax.nn.dot_product_attention(...,
  implementation="cudnn")` on float32 operands (causal mask, padding by lengths), under
  `mpjax.autocast` with the same policy;
- `autocast_linen`: the linen model with `attention_fn=mpjax.nn.dot_product_attention`, under
  `mpjax.autocast`.
"""

from __future__ import annotations

import argparse
import json
import re
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
    attention_fn: object = nn.dot_product_attention

    @nn.compact
    def __call__(self, x, lengths):
        attention = nn.MultiHeadDotProductAttention(HEADS, attention_fn=self.attention_fn)
        return nn.Dense(D)(attention(nn.Dense(D)(x), mask=masks(lengths)))


def figures(step, *args) -> dict:
    text = compile_step(step, args, h100_sharding(), donate_argnums=()).as_text()
    targets = re.findall(r'custom_call_target="([^"]*)"', text)
    return {
        "gemm_flops": hlo_cost.analyze(text).gemm_flops,
        "attention": sorted(t for t in targets if t.startswith("__cudnn$fmha")),
    }


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


def linen_program(wrap=lambda m: mpjax.apply_policy(m, POLICY), attention_fn=None):
    module = LinenModel() if attention_fn is None else LinenModel(attention_fn)
    model = wrap(module)
    apply = model.apply if hasattr(model, "apply") else model
    x = jnp.zeros((B, T, D))
    params = jax.eval_shape(module.init, jax.random.key(0), x, jnp.full((B,), T))

    def step(params, x, lengths):
        def loss(params):
            return jnp.mean(apply(params, x, lengths).astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step, params


def autocast_program():
    """`jax.nn.dot_product_attention(implementation="cudnn")` on float32, under autocast."""

    def forward(params, x, lengths):
        q, k, v = (jnp.einsum("btd,dhk->bthk", x, params[n]) for n in "qkv")
        h = jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            implementation="cudnn",
        )
        return jnp.einsum("bthk,hkd->btd", h, params["o"])

    params = {n: jax.ShapeDtypeStruct((D, HEADS, D // HEADS), jnp.float32) for n in "qkv"}
    params["o"] = jax.ShapeDtypeStruct((HEADS, D // HEADS, D), jnp.float32)
    apply = mpjax.autocast(forward, POLICY)

    def step(params, x, lengths):
        def loss(params):
            return jnp.mean(apply(params, x, lengths).astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step, params


def autocast_linen_program():
    """The linen model with `attention_fn=mpjax.nn.dot_product_attention`, under autocast."""
    return linen_program(lambda m: mpjax.autocast(m.apply, POLICY), mpjax.nn.dot_product_attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures to this file")
    out = Path(parser.parse_args().json)
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    result = {}
    programs = (
        ("nnx", nnx_program),
        ("linen", linen_program),
        ("autocast", autocast_program),
        ("autocast_linen", autocast_linen_program),
    )
    for name, program in programs:
        try:  # one program's failure (e.g. cuDNN's float32 check) is reported by its own tests
            step, params = program()
            result[name] = figures(step, params, x, lengths)
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {e}"}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
