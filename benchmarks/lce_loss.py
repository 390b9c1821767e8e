"""The fused loss alone on the cost model: GPT-2 small's loss, FSDP over 8 deviceless H100s.

`jax.value_and_grad` of the loss wrt the hidden states and the head kernel: the
hand-written float32 loss (`(x @ kernel.astype(bf16)).astype(float32)`, then optax's
cross-entropy with the padding mask) against `mpjax.nn.linear_cross_entropy` (chunks of
512 and 1024 tokens), on the global batch (the LM's `gpt2x8` size: 64 x 1024 tokens, 8192
per GPU; vocabulary 50304), x split on the batch and the kernel split as the suite's FSDP
cases split it: per-GPU temp, bytes and roofline, and their ratios to the unfused loss.
The whole train steps with the fused loss (`bf16-lce`, `policy-lce`) and the int8 state
(`bf16-params-remainder-int8-state`) are rows of the `cost` and `multi-gpu` tables; the
optimizer step of the int8 state against the bf16 state is the `memory` table's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.harness import TARGETS, _fsdp_spec, _mesh, hlo_figures
from benchmarks.train_models import LM_SIZES
from benchmarks.train_variants import lm_config
from mpjax.nn import linear_cross_entropy

__all__ = ["run"]

MIB = 2**20
CHUNKS = (512, 1024)


def _unfused(x, kernel, labels, padding):
    logits = (x @ kernel.astype(jnp.bfloat16)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * padding) / jnp.maximum(jnp.sum(padding), 1)


def _fused(chunk_size):
    def loss(x, kernel, labels, padding):
        labels = jnp.where(padding, labels, -1)
        return linear_cross_entropy(
            x, kernel, labels, ignore_index=-1, chunk_size=chunk_size, dtype=jnp.bfloat16
        )

    return loss


def run(quick: bool = False) -> dict:
    """The loss table (temp, bytes, roofline per GPU; ratios to the unfused float32 loss)."""
    size = "quickx8" if quick else "gpt2x8"
    cfg = lm_config(LM_SIZES[size], size)
    mesh = _mesh(TARGETS["h100x8"][0], "fsdp")
    b, t, d, v = cfg["batch"], cfg["seq"], cfg["d"], cfg["vocab"]

    def placed(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (
        placed((b, t, d), jnp.bfloat16, P("fsdp")),
        placed((d, v), jnp.float32, _fsdp_spec((d, v), mesh.shape["fsdp"], "fsdp")),
        placed((b, t), jnp.int32, P("fsdp")),
        placed((b, t), jnp.bool_, P("fsdp")),
    )
    losses = {"unfused float32 loss": _unfused}
    losses.update({f"linear_cross_entropy chunk {c}": _fused(c) for c in CHUNKS})
    figures = {}
    for name, fn in losses.items():
        compiled = jax.jit(jax.value_and_grad(fn, (0, 1))).trace(*args).lower().compile()
        hlo = hlo_figures(compiled.as_text())
        figures[name] = {
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "bytes": hlo["bytes"],
            "roofline_s": hlo["roofline_s"],
        }
    ref = figures["unfused float32 loss"]
    rows = [
        [
            name,
            round(f["temp_bytes"] / MIB, 1),
            round(f["roofline_s"] * 1e3, 3),
            round(f["bytes"] / MIB, 1),
            round(f["temp_bytes"] / ref["temp_bytes"], 3),
            round(f["roofline_s"] / ref["roofline_s"], 3),
        ]
        for name, f in figures.items()
    ]
    return {
        "title": "The loss alone (value and grad), per GPU: fused vs the float32 loss",
        "columns": ["loss", "temp MiB", "roofline ms", "bytes MiB"]
        + ["temp vs f32", "roofline vs f32"],
        "rows": rows,
        "notes": f"jax {jax.__version__}; 8 deviceless H100s, FSDP; LM size {size}: {cfg}.",
        "details": figures,
    }
