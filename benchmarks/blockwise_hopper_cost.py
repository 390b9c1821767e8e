"""Blockwise fp8 (DeepSeek-V3) on Hopper: the forms of one forward GEMM on the H100 cost model.

The lowerings of `Fp8Recipe("blockwise")` on an H100, against bf16 and tensorwise fp8, for
`[8192, 4096] x [4096, 4096]` in bf16 compute (deviceless H100, default compile options,
`hlo_cost.analyze`'s roofline; `--quick`: `[1024, 512] x [512, 512]`):

- `bf16`: the plain GEMM;
- `tensorwise fp8`: `fp8_dot_general` with `Fp8Recipe("tensorwise")`;
- `blockwise Pallas kernel`: what ships (`block_lowering="native"`, the default on Hopper):
  mpjax's kernel, fp8 GEMMs promoted per 128-wide K block inside the accumulator;
- `blockwise emulated`: operands quantised per block, dequantised to bf16;
- `blockwise batched fp8 (XLA)`: the per-K-block formulation in XLA: one fp8 GEMM batched
  over the K/128 blocks (`[K/128, M, N]` partial products), each partial scaled by its
  float32 block scales and summed (per-block promotion outside the GEMM).

    python benchmarks/run.py --only blockwise-hopper
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mpjax import Fp8Recipe
from mpjax._src.analysis.hlo_cost import analyze
from mpjax._src.analysis.target import compile_step, h100_sharding
from mpjax.fp8 import fp8_dot_general

__all__ = ["run"]

B = 128
DIMS = (((1,), (0,)), ((), ()))
BF16 = jnp.bfloat16


def plain(x, w):
    # the same product of every form: [M, K] x [K, N] in bf16 compute
    return lax.dot_general(x, w, DIMS, preferred_element_type=BF16)


def tensorwise(x, w):
    return fp8_dot_general(x, w, DIMS, Fp8Recipe("tensorwise"), BF16)


def blockwise(x, w, lowering):
    return fp8_dot_general(x, w, DIMS, Fp8Recipe("blockwise", block_lowering=lowering), BF16)


def batched_fp8(x, w):
    (M, K), N = x.shape, w.shape[1]
    kb = K // B
    x3 = x.reshape(M, kb, B).astype(jnp.float32)
    sx = jnp.max(jnp.abs(x3), axis=2, keepdims=True) / 448 + 1e-30  # [M, kb, 1]
    qx = (x3 / sx).astype(jnp.float8_e4m3fn)
    w4 = w.reshape(kb, B, N // B, B).astype(jnp.float32)
    sw = jnp.max(jnp.abs(w4), axis=(1, 3), keepdims=True) / 448 + 1e-30  # [kb, 1, nb, 1]
    qw = (w4 / sw).astype(jnp.float8_e4m3fn).reshape(kb, B, N)
    dims = (((2,), (1,)), ((1,), (0,)))  # batched over the K blocks: [kb, M, N]
    part = lax.dot_general(qx, qw, dims, preferred_element_type=BF16)
    row = jnp.transpose(sx[..., 0], (1, 0))[:, :, None]
    col = jnp.repeat(sw[:, 0, :, 0], B, axis=1)[:, None, :]
    return jnp.sum(part.astype(jnp.float32) * (row * col), axis=0).astype(BF16)


def run(quick: bool = False) -> dict:
    """The roofline of each form of the GEMM on the deviceless H100, against bf16."""
    m, k, n = (1024, 512, 512) if quick else (8192, 4096, 4096)
    sharding = h100_sharding()
    args = (jax.ShapeDtypeStruct((m, k), BF16), jax.ShapeDtypeStruct((k, n), BF16))
    forms = [
        ("bf16", plain),
        ("tensorwise fp8", tensorwise),
        ("blockwise Pallas kernel (ships)", functools.partial(blockwise, lowering="native")),
        ("blockwise emulated", functools.partial(blockwise, lowering="emulated")),
        ("blockwise batched fp8 (XLA)", batched_fp8),
    ]
    rows, base = [], None
    for name, fn in forms:
        report = analyze(compile_step(fn, args, sharding, donate_argnums=()).as_text())
        base = base or report.roofline_s
        flops = ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(report.gemm_flops.items()))
        rows.append(
            [name, round(report.roofline_s * 1e6, 1), round(report.roofline_s / base, 3)]
            + [flops, round(report.bytes / 1e9, 3)]
        )
    return {
        "title": f"Blockwise fp8 forward GEMM [{m}, {k}] x [{k}, {n}] on the H100 cost model",
        "columns": ["form", "roofline us", "vs bf16", "GEMM GFLOP by dtype", "GB accessed"],
        "rows": rows,
        "notes": "Forward only, bf16 compute, quantisation included (deviceless H100).",
    }
