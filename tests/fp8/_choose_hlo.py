"""Deviceless B200 compiles for tests/fp8/test_choose_gpu.py (under the gpu-aot python).

Writes one JSON object to `--json PATH`: for one GEMM `[M, K] x [K, N]` (bfloat16 operands,
output gradient `g` `[M, N]`), the kernels of the optimized HLO of
- `nvfp4_gradient`: NVFP4's quantisation of `g` as `block_scaled_dot_general`'s backward
  makes it (both copies, the columns Hadamard-rotated and rounded stochastically with the
  seed from `g`'s bits): `bytes` summed over its kernels and `elements` of `g`;
- `mxfp8_step` / `nvfp4_step`: the GEMM's forward and both gradients under the native
  recipe: each cuDNN block-scaled GEMM's result dtypes (`gemm_results`).
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
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.target import B200_TARGET, h100_topology, lower_step  # noqa: E402
from mpjax._src.fp8.block_dot import block_scaled_dot_general, gradient_seed  # noqa: E402
from mpjax.fp8 import quantize_orientations  # noqa: E402

M, K, N = 2048, 512, 1024
DIMS = (((1,), (0,)), ((), ()))


def _kernels(fn, *shapes):
    device = h100_topology(target=B200_TARGET).devices[0]
    args = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)
    sharding = jax.sharding.make_single_device_sharding(device)
    text = lower_step(fn, args, sharding, donate_argnums=()).compile().as_text()
    return hlo_cost.analyze(text).kernels


def nvfp4_gradient(g):
    q = quantize_orientations(
        g,
        mpjax.Fp8Recipe("nvfp4", block_lowering="native"),
        role="gradient",
        column_hadamard=True,
        column_seed=gradient_seed(g),
        impl="auto",
    )
    return q.rows, q.columns


def step(scaling):
    recipe = mpjax.Fp8Recipe(scaling, block_lowering="native")

    def fn(x, w, g):
        f = lambda a, b: block_scaled_dot_general(a, b, DIMS, recipe, jnp.bfloat16)  # noqa: E731
        out, vjp = jax.vjp(f, x, w)
        return out, *vjp(g)

    return fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    out_path = parser.parse_args().json
    kernels = _kernels(nvfp4_gradient, (M, N))
    result = {"nvfp4_gradient": {"bytes": sum(k.bytes for k in kernels), "elements": M * N}}
    for scaling in ("mxfp8", "nvfp4"):
        kernels = _kernels(step(scaling), (M, K), (K, N), (M, N))
        gemms = [list(k.results) for k in kernels if k.kind == "cudnn block-scaled gemm"]
        result[f"{scaling}_step"] = {"gemm_results": gemms}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
