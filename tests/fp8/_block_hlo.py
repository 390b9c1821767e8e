"""Deviceless B200 and H100 compiles for tests/fp8/test_block_gpu.py (under the gpu-aot python).

Writes one JSON object to `--json PATH`: for each block-scaled recipe and target (MXFP8 and
NVFP4 on the B200, blockwise on the H100), the GEMMs of the optimized HLO of one training
step (loss and gradients) of a small pre-LN transformer LM (attention, MLP, vocabulary head)
under `autocast(..., "bfloat16", fp8=recipe)`: their FLOPs by operand dtype (`flops`) and
each GEMM's operand dtypes and name stack (`gemms`), the fused quantiser's launches' bytes
(`quantize`) and what the quantisations read and write (`io`, `quantise_io`: per quantised
tensor its role, quantise kernels and whether the fused kernel made it; the transposes,
float32 copies and float32 operands of the quantised tensors, as `"dtype[shape] kernel (op)"`);
and for `block_lowering="auto"` on the GPU (MXFP8 on a mesh, blockwise through `lower_step`)
the digests of the step lowered as auto, native and emulated (`lowerings`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.quantise_io import quantise_io  # noqa: E402
from mpjax._src.analysis.target import (  # noqa: E402
    B200_TARGET,
    H100_TARGET,
    h100_topology,
    lower_step,
)
from mpjax._src.fp8.block_quantize_kernel import KERNEL_NAME as QUANTIZE  # noqa: E402
from mpjax._src.kernels.blockwise_gemm import KERNEL_NAME as BLOCKWISE  # noqa: E402

B, T, D, H, V = 4, 128, 512, 4, 2048


def lm_loss(params, tokens):
    """A one-block pre-LN transformer LM's next-token loss (plain JAX)."""
    x = params["embed"][tokens]
    h = jax.nn.standardize(x, axis=-1)
    q, k, v = jnp.split(h @ params["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(B, T, H, D // H) for t in (q, k, v))
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, D)
    x = x + att @ params["proj"]
    h = jax.nn.standardize(x, axis=-1)
    x = x + jax.nn.gelu(h @ params["up"]) @ params["down"]
    logits = jax.nn.standardize(x, axis=-1) @ params["head"]
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


SHAPES = {
    "embed": (V, D),
    "qkv": (D, 3 * D),
    "proj": (D, D),
    "up": (D, 4 * D),
    "down": (4 * D, D),
    "head": (D, V),
}


def lowered_step(target: Path, scaling: str, lowering: str = "native", placed: str = "device"):
    """The step lowered for `target` (not compiled); `placed`: the arguments on the topology's
    device (`"device"`), on a one-device mesh of it (`"mesh"`), or through mpjax's
    `lower_step` (`"lower_step"`, what `mpjax.report` compiles with)."""
    device = h100_topology(target=target).devices[0]
    sharding = jax.sharding.make_single_device_sharding(device)
    if placed == "mesh":
        mesh = jax.sharding.Mesh(np.array([device]), ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # every dense GEMM in the format (NVFP4 would keep the head, its last GEMM, in bf16)
    recipe = mpjax.Fp8Recipe(
        scaling=scaling, block_lowering=lowering, min_dim=64, high_precision_last=0
    )
    loss = mpjax.autocast(lm_loss, "params=float32,compute=bfloat16,output=float32", fp8=recipe)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for k, s in SHAPES.items()}
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sharding)
    if placed == "lower_step":
        shapes = ({k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}, tokens)
        return lower_step(jax.value_and_grad(loss), shapes, sharding, donate_argnums=())
    return jax.jit(jax.value_and_grad(loss)).trace(params, tokens).lower()


def runs(text: str, needle: str) -> int:
    """How many times the StableHLO program `text` runs the lines holding `needle`: each
    function's own, times the calls of that function (a jitted function's is one body that
    every call site of the same shapes shares)."""
    bodies = re.split(r"^\s*func\.func \w+ @", text, flags=re.M)[1:]
    funcs = {body.split("(", 1)[0]: body for body in bodies}

    @functools.cache
    def count(name: str) -> int:
        body = funcs[name]
        calls = re.findall(r"(?<!\w)call @([\w.$-]+)\(", body)
        return body.count(needle) + sum(count(callee) for callee in calls)

    return count("main")


def lowerings(target: Path, scaling: str, placed: str) -> dict:
    """SHA-256 of the StableHLO text of the step lowered with each `block_lowering`, and
    (`kernels`) how many times it runs a blockwise GEMM kernel: Mosaic GPU and Triton ones."""
    out, kernels = {}, {}
    for lowering in ("auto", "native", "emulated"):
        text = lowered_step(target, scaling, lowering, placed).as_text()
        out[lowering] = hashlib.sha256(text.encode()).hexdigest()
        kernels[lowering] = {
            "mosaic_gpu": runs(text, "custom_call @mosaic_gpu"),
            # the Triton kernel's name, NUL-separated in its serialized module
            "triton": runs(text, f"\\00{BLOCKWISE}\\00"),
        }
    return {**out, "kernels": kernels}


def step_gemms(target: Path, scaling: str) -> dict:
    """The GEMMs, quantiser launches and quantisation io of the step compiled for `target`
    (`block_lowering="native"`, the arguments on the topology's device)."""
    text = lowered_step(target, scaling).compile().as_text()
    report = hlo_cost.analyze(text)
    gemms = [[g.lhs_dtype, g.rhs_dtype, g.op_name] for g in report.gemms]
    # the fused quantiser's launches (Triton custom calls named so) and their bytes
    names = set(re.findall(rf"%?([\w.\-]+) = [^\n]*__gpu\$xla\.gpu\.triton[^\n]*{QUANTIZE}", text))
    quantize = [k.bytes for k in report.kernels if k.name in names]
    io = quantise_io(text)
    return {
        "flops": dict(report.gemm_flops),
        "gemms": gemms,
        "quantize": quantize,
        "io": {
            "tensors": [[t.role, len(t.kernels), t.fused] for t in io.tensors],
            "transposes": list(io.transposes),
            "f32_copies": list(io.float32_copies),
            "f32_operands": list(io.float32_operands),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    out = {f"b200/{s}": step_gemms(B200_TARGET, s) for s in ("mxfp8", "nvfp4")}
    out["h100/blockwise"] = step_gemms(H100_TARGET, "blockwise")
    # block_lowering="auto" lowered ahead of time for the GPU (issue 35): the program of the
    # lowering auto picks there (each placement on one target). Lowered, not compiled: the
    # same StableHLO compiles to the same program, and every compile here costs CI a minute.
    out["b200/mxfp8/auto/mesh"] = lowerings(B200_TARGET, "mxfp8", "mesh")
    out["h100/blockwise/auto/lower_step"] = lowerings(H100_TARGET, "blockwise", "lower_step")
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
