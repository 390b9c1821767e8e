"""Deviceless H100 compiles for tests/fp8/test_emulated_on_gpu.py (under the gpu-aot python).

Writes to `--json PATH`, for each program, how many instructions of its optimized HLO
produce or read the 8-bit/4-bit format: a quantise -> dequantise round trip
(`dequantize(quantize(x))`, `dequantize_blocks(quantize_blocks(x))`) and a training step of
an emulated block-scaled GEMM, which XLA:GPU would compute in float32 without rounding if
it dropped the round trip (its excess-precision simplification).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.analysis.target import h100_sharding, lower_step  # noqa: E402
from mpjax.fp8 import (  # noqa: E402
    block_scaled_dot_general,
    dequantize,
    dequantize_blocks,
    quantize,
    quantize_blocks,
)

LOW = {"mxfp8": "f8e4m3fn", "nvfp4": "f4e2m1fn", "blockwise": "f8e4m3fn", "tensorwise": "f8e4m3fn"}
DIMS = (((1,), (0,)), ((), ()))


def _programs():
    x, w = jnp.ones((256, 512)), jnp.ones((512, 384))
    s = jnp.float32(2.0)
    out = {
        "tensorwise/roundtrip": (lambda x: dequantize(quantize(x, s, jnp.float8_e4m3fn), s), (x,))
    }
    for scaling in ("mxfp8", "nvfp4", "blockwise"):
        out[f"{scaling}/roundtrip"] = (
            lambda x, s=scaling: dequantize_blocks(quantize_blocks(x, s)),
            (x,),
        )
        recipe = mpjax.Fp8Recipe(scaling, block_lowering="emulated")

        def loss(x, w, recipe=recipe):
            return jnp.sum(block_scaled_dot_general(x, w, DIMS, recipe, jnp.float32) ** 2)

        out[f"{scaling}/emulated-step"] = (jax.grad(loss, argnums=(0, 1)), (x, w))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    args = p.parse_args()
    counts = {}
    for name, (fn, operands) in _programs().items():
        text = lower_step(fn, operands, h100_sharding(), donate_argnums=()).compile().as_text()
        counts[name] = text.count(LOW[name.split("/")[0]] + "[")
    Path(args.json).write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
