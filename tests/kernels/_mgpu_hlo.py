"""Deviceless H100 compiles for tests/kernels/test_blockwise_gemm_mgpu_gpu.py (gpu-aot python).

Writes one JSON object to `--json PATH`:
- `kernel`: the Mosaic GPU blockwise GEMM alone at one of the wide LM's shapes (tokens
  8192, K 4096, N 16384, bfloat16 out): the compiled program's custom calls
  (`[target, op_name]`) and what Mosaic GPU's compile wrote about the kernel, as asked by
  `MOSAIC_GPU_DUMP_PTX` / `MOSAIC_GPU_DUMP_PTXAS` / `MOSAIC_GPU_DUMP_TO` in the environment
  (`ptx`: its wgmma and TMA instructions and target; `ptxas`: the assembler's report);
- `routing`: which kernel `block_lowering="native"` runs for one dense layer on each GPU.
The wide LM's whole step: benchmarks/tests/_mgpu_step_hlo.py (tests may not import benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mpjax._src.analysis.target import (  # noqa: E402
    B200_TARGET,
    H100_TARGET,
    h100_sharding,
    h100_topology,
    lower_step,
)
from mpjax._src.kernels.blockwise_gemm import KERNEL_NAME, blockwise_fp8_gemm  # noqa: E402

TOKENS, D, MLP = 8192, 4096, 16384
TMA_LOAD = r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global"  # global -> shared


def _custom_calls(text: str) -> list:
    calls = re.findall(r'custom_call_target="([^"]+)"[^\n]*?op_name="([^"]*)"', text)
    return [list(c) for c in calls]


def _dumped() -> dict:
    """What Mosaic GPU's compile wrote under `$MOSAIC_GPU_DUMP_TO` (empty where unset)."""
    folder = os.environ.get("MOSAIC_GPU_DUMP_TO")
    out = {"ptx": {}, "ptxas": ""}
    if not folder:
        return out
    for path in sorted(Path(folder).glob("*.ptx")):
        text = path.read_text()
        out["ptx"][path.stem] = {
            "target": re.findall(r"^\.target (\S+)", text, re.M),
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", text))),
            "tma_loads": len(re.findall(TMA_LOAD, text)),
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.\w+", text))),
        }
    out["ptxas"] = "".join(p.read_text() for p in sorted(Path(folder).glob("*.ptxas")))
    return out


def kernel_alone() -> dict:
    args = (
        jax.ShapeDtypeStruct((TOKENS, D), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((TOKENS, D // 128), jnp.float32),
        jax.ShapeDtypeStruct((MLP, D), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((MLP, D // 128), jnp.float32),
    )

    def gemm(*xs):
        return blockwise_fp8_gemm(*xs, out_dtype=jnp.bfloat16, impl="pallas", kernel="mosaic_gpu")

    text = lower_step(gemm, args, h100_sharding(), donate_argnums=()).compile().as_text()
    return {"custom_calls": _custom_calls(text), **_dumped()}


def routing() -> dict:
    """Per target, the blockwise GEMM kernels of one dense layer's gradient step lowered with
    `block_lowering="native"`: Mosaic GPU custom calls and Triton blockwise GEMMs."""
    import mpjax
    from mpjax.fp8 import block_scaled_dot_general

    recipe = mpjax.Fp8Recipe("blockwise", block_lowering="native")
    dims = (((1,), (0,)), ((), ()))

    def loss(x, w):
        return jnp.sum(block_scaled_dot_general(x, w, dims, recipe, jnp.bfloat16))

    args = (
        jax.ShapeDtypeStruct((256, 512), jnp.float32),
        jax.ShapeDtypeStruct((512, 256), jnp.float32),
    )
    out = {}
    for name, target in (("h100", H100_TARGET), ("b200", B200_TARGET)):
        sharding = jax.sharding.make_single_device_sharding(h100_topology(target=target).devices[0])
        text = lower_step(
            jax.value_and_grad(loss, (0, 1)), args, sharding, donate_argnums=()
        ).as_text()
        out[name] = {
            "mosaic_gpu": len(re.findall(r"custom_call @mosaic_gpu", text)),
            "triton": text.count(f"\\00{KERNEL_NAME}\\00"),  # NUL-separated in its module
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    out = {"jax": jax.__version__, "kernel": kernel_alone(), "routing": routing()}
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
