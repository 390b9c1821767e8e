"""Blockwise fp8 (DeepSeek-V3) on Hopper in XLA: one forward GEMM on the H100 cost model.

A candidate H100 lowering of `Fp8Recipe("blockwise")` as fp8 GEMMs in XLA, against the
forms that exist, for `[8192, 4096] x [4096, 4096]` in bf16 compute (deviceless H100,
default compile options, `hlo_cost.analyze`'s roofline):

- `bf16`: the plain GEMM;
- `tensorwise fp8`: `fp8_dot_general` with `Fp8Recipe("tensorwise")`;
- `blockwise emulated`: what ships (operands quantised per block, dequantised to bf16);
- `blockwise batched fp8`: the per-K-block formulation: 1x128 / 128x128 e4m3 operands, one
  fp8 GEMM batched over the K/128 blocks (`[K/128, M, N]` partial products), each partial
  scaled by its float32 block scales and summed (per-block promotion outside the GEMM).

    JAX_PLATFORMS=cpu <gpu-aot python> benchmarks/blockwise_hopper_cost.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from mpjax import Fp8Recipe  # noqa: E402
from mpjax._src.analysis.hlo_cost import analyze  # noqa: E402
from mpjax._src.analysis.target import compile_step, h100_sharding  # noqa: E402
from mpjax.fp8 import fp8_dot_general  # noqa: E402

M, K, N, B = 8192, 4096, 4096, 128
DIMS = (((1,), (0,)), ((), ()))
BF16 = jnp.bfloat16


def plain(x, w):
    return lax.dot_general(x, w, DIMS, preferred_element_type=BF16)


def tensorwise(x, w):
    return fp8_dot_general(x, w, DIMS, Fp8Recipe("tensorwise"), BF16)


def emulated(x, w):
    return fp8_dot_general(x, w, DIMS, Fp8Recipe("blockwise", block_lowering="emulated"), BF16)


def batched_fp8(x, w):
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


def main() -> None:
    sharding = h100_sharding()
    args = (jax.ShapeDtypeStruct((M, K), BF16), jax.ShapeDtypeStruct((K, N), BF16))
    forms = [
        ("bf16", plain),
        ("tensorwise fp8", tensorwise),
        ("blockwise emulated", emulated),
        ("blockwise batched fp8", batched_fp8),
    ]
    base = None
    for name, fn in forms:
        report = analyze(compile_step(fn, args, sharding, donate_argnums=()).as_text())
        base = base or report.roofline_s
        print(
            f"{name:24s} {report.roofline_s * 1e3:.3f} ms ({report.roofline_s / base:.2f}x bf16)"
            f"  GEMM FLOPs {report.gemm_flops}  bytes {report.bytes / 1e9:.2f} GB"
        )


if __name__ == "__main__":
    main()
