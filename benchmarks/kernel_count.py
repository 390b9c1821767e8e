"""GPU kernels and bytes per loss-scaled optimizer step, from a deviceless XLA:GPU compile for H100.

Needs the `gpu-aot` extra (the `jax-cuda12-plugin` and `jax-cuda12-pjrt` wheels of the pinned
jaxlib, installed with `--no-deps`; keep them out of a CPU-only environment) and no GPU:

    python3 -m venv /tmp/venv-gpuaot
    /tmp/venv-gpuaot/bin/pip install jax==0.10.2 jaxlib==0.10.2 flax optax chex
    /tmp/venv-gpuaot/bin/pip install --no-deps jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2
    JAX_PLATFORMS=cpu /tmp/venv-gpuaot/bin/python benchmarks/kernel_count.py

Each optimizer step (update + apply_updates, gradients given) of a 120-leaf model is compiled
with `jax.jit(...).trace(...).lower().compile()` for the target described by
`mpjax/_src/analysis/h100.txtpb`, and read by the GPU cost model's HLO analysis
(`mpjax/_src/analysis/hlo_cost.py`,
the same as `benchmarks/gpu_cost_model.py`): kernels, bytes accessed, temp memory and roofline.
The full fp16 train step of `benchmarks/step_overhead.py`'s MLP (60 Dense layers, float32
params, float16 compute, donated) is compiled the same way for the bare optax step, mpjax's
default, mpjax with `impl="pallas"` and the Flax DynamicScale / optax.apply_if_finite / jmp
patterns. Without the plugin, `run()` runs this script with the python of
`$MPJAX_GPU_AOT_PYTHON`, or reports itself skipped. `--json PATH` writes the result (rows
and per-pattern figures).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mpjax  # noqa: E402
from benchmarks import step_overhead  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from benchmarks.gpu_cost_model import (  # noqa: E402
    compile_step,
    delegate_to_gpu_aot,
    h100_sharding,
    measure,
    plugin_available,
)

REQUIRES_GPU = False  # compiles for a GPU; runs without one
TITLE = "GPU kernels and bytes per optimizer step (deviceless XLA:GPU compile for H100)"
COLUMNS = [
    "pattern",
    "params",
    "kernels",
    "MB accessed",
    "bytes vs bare step",
    "temp MiB",
    "roofline us",
]


def _model(n_blocks: int, width: int, dtype) -> dict:
    """4 leaves per block: a (width, width) kernel, a bias and a norm scale and bias."""
    return {
        f"block{i}": {
            "kernel": jax.ShapeDtypeStruct((width, width), dtype),
            "bias": jax.ShapeDtypeStruct((width,), dtype),
            "norm_scale": jax.ShapeDtypeStruct((width,), dtype),
            "norm_bias": jax.ShapeDtypeStruct((width,), dtype),
        }
        for i in range(n_blocks)
    }


def _optax_step(tx):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init


def _flax_dynamic_scale_step(tx):
    """The step of flax.training.dynamic_scale.DynamicScale's documented train-step pattern:
    unscale, all-finite check leaf by leaf, update, then `jnp.where` over params and opt_state,
    and the scale update."""

    def step(carry, opt_state, grads):
        params, scale, fin_steps = carry
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = jnp.array(True)
        for g in jax.tree.leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, finite)
        new_params = jax.tree.map(select, new_params, params)
        new_opt_state = jax.tree.map(select, new_opt_state, opt_state)
        grow = fin_steps + 1 >= 2000
        new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
        new_fin_steps = jnp.where(finite & ~grow, fin_steps + 1, 0)
        return (new_params, new_scale, new_fin_steps), new_opt_state

    def init(carry):
        return tx.init(carry[0])

    return step, init


def _measure(step, init, params, grads, sharding) -> dict:
    opt_state = jax.eval_shape(init, params)
    compiled = compile_step(step, (params, opt_state, grads), sharding, donate_argnums=(0, 1))
    return measure(compiled)


def _pallas_train_step(state, batch):
    """`step_overhead.mpjax_step` with the check forced onto the Pallas kernel."""
    params, opt_state = state
    tx = mpjax.loss_scaled(optax.adam(step_overhead.LR), impl="pallas")

    def scaled(p):
        loss = step_overhead.loss_fn(p, batch)
        return mpjax.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def _train_step_rows(sharding, quick: bool) -> tuple[list, list]:
    """The full fp16 train step (`benchmarks/step_overhead.py`'s MLP, f32 params, fp16
    compute, donated) per loss-scaling pattern: rows and details, bytes vs the bare step."""
    so = step_overhead
    cfg = dict(so.QUICK if quick else so.FULL)
    params = jax.eval_shape(lambda: so.init_params(jax.random.key(0), cfg["depth"], cfg["width"]))
    batch = (jax.ShapeDtypeStruct((cfg["batch"], cfg["width"]), jnp.float32),) * 2
    variants = {name: v for name, v in so.variants().items() if name != so.FP16_PARAMS}
    variants[f"{so.MPJAX} impl='pallas'"] = (so.mpjax_init, _pallas_train_step)
    rows, details, base = [], [], None
    for name, (init, step) in variants.items():
        state = jax.eval_shape(init, params)
        figures = measure(compile_step(step, (state, batch), sharding))
        base = base or figures
        pattern = f"full fp16 train step: {name}"
        details.append({"pattern": pattern, "params": "f32, fp16 compute", **figures})
        rows.append(
            [
                pattern,
                "f32, fp16 compute",
                figures["kernels"],
                round(figures["bytes"] / 1e6, 2),
                round(figures["bytes"] / base["bytes"], 3),
                round(figures["temp_bytes"] / 2**20, 2),
                round(figures["roofline_s"] * 1e6, 1),
            ]
        )
    return rows, details


def run(quick: bool = False) -> dict:
    """Kernels and bytes per optimizer step and per full fp16 train step (module docstring)."""
    if not plugin_available():
        return delegate_to_gpu_aot(Path(__file__), quick)
    sharding = h100_sharding()
    n_blocks, width = (6, 64) if quick else (30, 256)
    f32 = _model(n_blocks, width, jnp.float32)
    bf16 = _model(n_blocks, width, jnp.bfloat16)
    n_leaves = len(jax.tree.leaves(f32))
    adam = optax.adam(1e-3)

    def carry_params(params):
        return (params, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))

    pallas_scaled = mpjax.loss_scaled(adam, impl="pallas")
    default_scaled = mpjax.loss_scaled(adam)  # impl="auto": the grouped XLA check
    cases = [
        ("optax.adam (no loss scaling)", "f32", _optax_step(adam), f32, f32),
        (
            "flax DynamicScale pattern",
            "f32",
            _flax_dynamic_scale_step(adam),
            carry_params(f32),
            f32,
        ),
        (
            "optax.apply_if_finite(adam)",
            "f32",
            _optax_step(optax.apply_if_finite(adam, 10)),
            f32,
            f32,
        ),
        ("mpjax.loss_scaled(adam) (default)", "f32", _optax_step(default_scaled), f32, f32),
        ("mpjax.loss_scaled(adam, impl='pallas')", "f32", _optax_step(pallas_scaled), f32, f32),
        (
            "mpjax.loss_scaled(adam) (default)",
            "bf16 + f32 master",
            _optax_step(default_scaled),
            bf16,
            bf16,
        ),
        (
            "mpjax.loss_scaled(adam, impl='pallas')",
            "bf16 + f32 master",
            _optax_step(pallas_scaled),
            bf16,
            bf16,
        ),
    ]
    rows, details = [], []
    for name, params_kind, (step, init), params, grads in cases:
        figures = _measure(step, init, params, grads, sharding)
        details.append({"pattern": name, "params": params_kind, **figures})
        base = details[0]
        rows.append(
            [
                name,
                params_kind,
                figures["kernels"],
                round(figures["bytes"] / 1e6, 2),
                round(figures["bytes"] / base["bytes"], 3),
                round(figures["temp_bytes"] / 2**20, 2),
                round(figures["roofline_s"] * 1e6, 1),
            ]
        )
    step_rows, step_details = _train_step_rows(sharding, quick)
    rows += step_rows
    details += step_details
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "notes": (
            f"{n_leaves}-leaf model ({n_blocks} blocks of a {width}x{width} kernel, bias, norm "
            "scale and bias); one optimizer step with gradients given (jit, params and state "
            "donated), compiled deviceless for mpjax/_src/analysis/h100.txtpb with jax "
            f"{jax.__version__}, read by benchmarks/hlo_cost.py (kernels: every fusion, custom "
            "call and unfused op the program launches; bytes: operands + result per kernel). "
            "Targets for the loss-scaled step: <= 1.15x the bare step's bytes and <= 130 "
            "kernels for 120 leaves. 'full fp16 train step' rows: forward + backward + Adam "
            "of benchmarks/step_overhead.py's MLP (float32 params, float16 compute, state "
            "donated), bytes vs its bare optax step; target for mpjax's default <= 1.05x."
        ),
        "details": details,
        "n_leaves": n_leaves,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 24-leaf model")
    parser.add_argument("--json", default=None, help="write the result to this file")
    args = parser.parse_args(argv)
    if not plugin_available():
        raise SystemExit("kernel_count: deviceless CUDA compile unavailable (no jax CUDA plugin)")
    result = run(quick=args.quick)
    return emit(result, args.json)


if __name__ == "__main__":
    main()
