"""The fused loss and the int8 state on the cost model: GPT-2 small, FSDP over 8 deviceless H100s.

1. The loss alone (`jax.value_and_grad` wrt the hidden states and the head kernel): the
   hand-written float32 loss (`(x @ kernel.astype(bf16)).astype(float32)` then optax's
   cross-entropy with the padding mask) against `mpjax.nn.linear_cross_entropy`, both on
   the global batch (64 x 1024 tokens, 8192 per GPU), vocabulary 50304, x split on the
   batch and the kernel FSDP-split as `benchmarks/multi_gpu_cost.py` splits it: per-GPU
   temp and the roofline of XLA's cost model.
2. The whole train step of `multi_gpu_cost.py`'s variants (the hand-written bf16 anchor,
   its fused-loss version, and bf16 params + remainder with bf16 or int8 Adam state):
   collectives, per-GPU temp and roofline, as ratios to the anchor.
3. The optimizer step alone on one H100 (`benchmarks/memory.py`'s step): bytes and kernels
   of the int8 state against the bf16 state.

    JAX_PLATFORMS=cpu $MPJAX_GPU_AOT_PYTHON benchmarks/lce_int8_cost.py [--quick] [--json P]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import benchmarks.gpu_cost_model as gcm  # noqa: E402
import benchmarks.multi_gpu_cost as mgc  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common import emit  # noqa: E402
from mpjax.nn import linear_cross_entropy  # noqa: E402

MIB = 2**20
STEP_VARIANTS = (
    "bf16",
    "bf16-lce",
    "bf16-params-remainder-bf16-state",
    "bf16-params-remainder-int8-state",
)
OPT_MODES = ("bf16 params + remainder + bf16 state", "bf16 params + remainder + int8 state")


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


def loss_rows(cfg: dict, chunk_sizes=(512, 1024)) -> list[dict]:
    mesh = mgc.make_mesh("1x1x8")
    n = mesh.shape[mgc.AXIS]
    b, t, d, v = cfg["batch"], cfg["seq"], cfg["d"], cfg["vocab"]

    def placed(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (
        placed((b, t, d), jnp.bfloat16, P(mgc.AXIS)),
        placed((d, v), jnp.float32, mgc.fsdp_spec((d, v), n)),
        placed((b, t), jnp.int32, P(mgc.AXIS)),
        placed((b, t), jnp.bool_, P(mgc.AXIS)),
    )
    rows = []
    losses = {"unfused float32 loss": _unfused}
    losses.update({f"linear_cross_entropy chunk {c}": _fused(c) for c in chunk_sizes})
    for name, fn in losses.items():
        step = jax.jit(jax.value_and_grad(fn, (0, 1)))
        m = gcm.measure(step.trace(*args).lower().compile())
        rows.append({"loss": name, **{k: m[k] for k in ("temp_bytes", "roofline_s", "bytes")}})
        print(f"[lce] {name}", file=sys.stderr, flush=True)
    return rows


def step_rows(cfg: dict, variants=STEP_VARIANTS) -> list[dict]:
    mesh = mgc.make_mesh("1x1x8")
    rows = []
    for variant in variants:
        compiled, _ = mgc.compile_fsdp(mgc.VARIANTS[variant](cfg), mesh)
        m = gcm.measure(compiled)
        records = mgc.collectives(compiled.as_text())
        rows.append(
            {
                "variant": variant,
                "collectives": len(records),
                "collective_bytes": sum(r.bytes for r in records),
                **{k: m[k] for k in ("temp_bytes", "roofline_s", "bytes", "kernels")},
            }
        )
        print(f"[step] {variant}", file=sys.stderr, flush=True)
    return rows


def optimizer_rows(size: str) -> list[dict]:
    import benchmarks.memory as memory

    sharding = memory.h100_sharding()
    rows = []
    for name in OPT_MODES:
        dtype, make = memory.MODES[name]
        tx = make()
        params = memory.lm_params(size, dtype)
        state = jax.eval_shape(tx.init, params)
        compiled = memory.compile_step(memory._step(tx), (params, state, params), sharding, (0, 1))
        m = gcm.measure(compiled)
        rows.append({"mode": name, **{k: m[k] for k in ("bytes", "roofline_s", "kernels")}})
    return rows


COLUMNS = [
    "section",
    "what",
    "temp MiB",
    "roofline ms",
    "bytes MiB",
    "kernels",
    "collectives",
    "collective MiB",
    "temp vs first",
    "roofline vs first",
    "bytes vs first",
]


def _table(section: str, rows: list[dict], key: str) -> list[list]:
    def get(r, k, scale=1.0, nd=2):
        return round(r[k] / scale, nd) if k in r else "-"

    def ratio(r, k):
        first = rows[0]
        return round(r[k] / first[k], 3) if k in r and first.get(k) else "-"

    return [
        [
            section,
            r[key],
            get(r, "temp_bytes", MIB, 1),
            get(r, "roofline_s", 1e-3, 3),
            get(r, "bytes", MIB, 1),
            r.get("kernels", "-"),
            r.get("collectives", "-"),
            get(r, "collective_bytes", MIB, 2),
            ratio(r, "temp_bytes"),
            ratio(r, "roofline_s"),
            ratio(r, "bytes"),
        ]
        for r in rows
    ]


SECTIONS = ("loss", "step", "optimizer")


def run(quick: bool = False, sections=SECTIONS, variants=STEP_VARIANTS) -> dict:
    cfg = mgc.config(quick)
    loss = loss_rows(cfg) if "loss" in sections else []
    step = step_rows(cfg, variants) if "step" in sections else []
    opt = optimizer_rows("quick" if quick else "gpt2") if "optimizer" in sections else []
    return {
        "title": "Fused loss and int8 state on the cost model" + (" (quick)" if quick else ""),
        "columns": COLUMNS,
        "rows": _table("loss (value and grad)", loss, "loss")
        + _table("train step", step, "variant")
        + _table("optimizer step, 1 GPU", opt, "mode"),
        "notes": f"jax {jax.__version__}; {cfg}; 8 deviceless H100s (FSDP) for the loss "
        "and the step (per-GPU figures); the optimizer step on one H100.",
        "details": {"loss": loss, "step": step, "optimizer": opt},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="of loss,step,optimizer")
    parser.add_argument("--variants", default=",".join(STEP_VARIANTS), help="train steps")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known {SECTIONS}")
    variants = [v for v in args.variants.split(",") if v]
    return emit(run(args.quick, sections, variants), args.json)


if __name__ == "__main__":
    main()
