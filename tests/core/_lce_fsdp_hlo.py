"""Deviceless 8-H100 compiles for tests/core/test_linear_cross_entropy_gpu.py (run under the
gpu-aot python).

Writes one JSON object to `--json PATH`: per axis type of the mesh (`"Auto"`, `"Explicit"`),
the collectives of the value and gradients (hidden states, head kernel) of
`mpjax.nn.linear_cross_entropy` (8 vocabulary tiles) on 8 H100s under FSDP (one `fsdp` axis:
the hidden states split along the batch, the `[d, vocab]` float32 kernel along the
vocabulary, as `benchmarks/` splits a train step; `{"error": ...}` for one that did not
compile), each
`[op, dtype, shape, bytes, runs]` with `runs` its runs per step (a `while` body's: the trip
count), those inside loops marked, and the roofline (`mpjax/_src/analysis/hlo_cost.py`);
also, on the Auto mesh, the loss in one tile (no loop) and the hand-written unfused loss.
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
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.collectives import collectives, loop_collectives  # noqa: E402
from mpjax._src.analysis.target import h100_topology, target_cudnn  # noqa: E402
from mpjax.nn import linear_cross_entropy  # noqa: E402

BATCH, SEQ, D, VOCAB = 16, 128, 128, 4096  # 2048 tokens


def loss(hidden, kernel, labels):
    # chunk_size 256: tiles of 256 * 4096 / 2048 = 512 columns, 8 of them
    return linear_cross_entropy(hidden, kernel, labels, chunk_size=256, dtype=jnp.bfloat16)


def one_tile(hidden, kernel, labels):
    """The whole vocabulary in one tile (no loop)."""
    return linear_cross_entropy(hidden, kernel, labels, chunk_size=BATCH * SEQ, dtype=jnp.bfloat16)


def unfused(hidden, kernel, labels):
    """The hand-written loss: bf16 logits, float32 log-softmax."""
    logits = (hidden @ kernel.astype(jnp.bfloat16)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def figures(axis_type: AxisType, fun=loss) -> dict:
    devices = h100_topology("1x1x8").devices
    mesh = Mesh(np.array(devices), ("fsdp",), axis_types=(axis_type,))

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (
        arg((BATCH, SEQ, D), jnp.bfloat16, P("fsdp")),
        arg((D, VOCAB), jnp.float32, P(None, "fsdp")),
        arg((BATCH, SEQ), jnp.int32, P("fsdp")),
    )
    out = (NamedSharding(mesh, P()), (args[0].sharding, args[1].sharding))
    step = jax.jit(jax.value_and_grad(fun, (0, 1)), out_shardings=out)
    with target_cudnn():
        text = step.trace(*args).lower().compile().as_text()
    looped = {c.name: runs for c, runs in loop_collectives(text)}
    return {
        "collectives": [
            [c.op, c.dtype, list(c.shape), c.bytes, looped.get(c.name, 1), c.name in looped]
            for c in collectives(text)
        ],
        "roofline_s": hlo_cost.analyze(text).roofline_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    path = parser.parse_args().json
    out = {}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        try:
            out[axis_type.name] = figures(axis_type)
        except Exception as e:  # noqa: BLE001 - the test reports it, the other program runs
            out[axis_type.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    # one tile (no loop): the partitioner's plan, against the hand-written loss's
    for name, fun in (("Auto/one-tile", one_tile), ("Auto/unfused", unfused)):
        out[name] = figures(AxisType.Auto, fun)
    Path(path).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
