"""Under the gpu-aot python: the collectives of the FSDP step with bf16 and int8 state on 8
deviceless H100s (topology "1x1x8"), the state built by `jax.eval_shape` + shardings and by
`jax.jit(tx.init, out_shardings=...)` (traced for the GPUs), and by eager `init` on the CPU
(its shapes placed by the same rule). Writes `{dtype/way: collectives}` to `--json`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.analysis.target import h100_topology
from tests.scaling import int8_layout_steps as steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    devices = h100_topology("1x1x8").devices
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    params = steps.abstract_params(mesh)
    out = {}
    for dtype in (jnp.bfloat16, jnp.int8):
        t = steps.tx(dtype)
        shardings = steps.state_shardings(jax.eval_shape(t.init, params), mesh)
        cpu = {k: jnp.zeros(x.shape, x.dtype) for k, x in params.items()}
        eager = t.init(cpu)  # eager on the host: its shapes, placed by the rule
        jitted = jax.eval_shape(jax.jit(t.init, out_shardings=shardings), params)
        abstract = jax.eval_shape(t.init, params)
        for way, state in (("eager", eager), ("eval_shape", abstract), ("jit", jitted)):
            placed = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
            )
            name = f"{jnp.dtype(dtype).name}/{way}"
            out[name] = steps.step_collectives(dtype, params, placed)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
