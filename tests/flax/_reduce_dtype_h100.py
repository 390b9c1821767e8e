"""Run under the gpu-aot python (tests/flax/test_reduce_dtype.py): gradient reductions on H100s.

Compiles the gradient of an FSDP-sharded `Dense` MLP under `mpjax.apply_policy`, and of the same
MLP as plain JAX under `mpjax.autocast`, for 8 deviceless H100s (`h100_topology("1x1x8")`), and
writes to `--json PATH`, per policy, the dtypes of the reduce-scatters / all-reduces of
kernel-sized arrays (the weight gradients) in the optimized HLO.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.analysis.collectives import collectives  # noqa: E402
from mpjax._src.analysis.target import h100_topology  # noqa: E402
from tests.helpers.models import TanhMLP  # noqa: E402

WIDTH, BATCH, LAYERS = 256, 4096, 3
POLICIES = (
    "p=f32,c=f16,o=f32",
    "p=f32,c=f16,o=f32,r=f32",
    "p=f32,c=f16,o=f32,r=bf16",
    "p=f32,c=bf16,o=f32",
    "p=f32,c=bf16,o=f32,r=f32",
)


def _plain(params, x):
    for i in range(LAYERS):
        x = jnp.tanh(x @ params[f"Dense_{i}"]["kernel"])
    return x


def _reduction_dtypes(forward, mesh, params) -> list:
    def loss(p, x):
        return jnp.mean(forward(p, x).astype(jnp.float32) ** 2)

    shard = NamedSharding(mesh, P("fsdp"))
    args = (
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard), params),
        jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=shard),
    )
    fn = jax.jit(jax.grad(loss), out_shardings=shard)
    text = fn.trace(*args).lower().compile().as_text()
    return sorted(
        c.dtype
        for c in collectives(text)
        if c.op in ("all-reduce", "reduce-scatter") and int(np.prod(c.shape)) == WIDTH * WIDTH
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    mesh = Mesh(np.array(h100_topology("1x1x8").devices), ("fsdp",))
    params = jax.eval_shape(TanhMLP(WIDTH, LAYERS).init, jax.random.key(0), jnp.zeros((1, WIDTH)))[
        "params"
    ]
    out = {}
    for policy in POLICIES:
        linen = mpjax.apply_policy(TanhMLP(WIDTH, LAYERS), policy)
        out[f"linen {policy}"] = _reduction_dtypes(
            lambda p, x, m=linen: m.apply({"params": p}, x), mesh, params
        )
        out[f"autocast {policy}"] = _reduction_dtypes(mpjax.autocast(_plain, policy), mesh, params)
    Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
