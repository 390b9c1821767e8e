"""GPU kernels per loss-scaled optimizer step, counted from a deviceless XLA:GPU compile for H100.

Needs the `gpu-aot` extra (the `jax-cuda12-plugin` and `jax-cuda12-pjrt` wheels of the pinned
jaxlib, installed with `--no-deps`; keep them out of a CPU-only environment) and no GPU:

    python3 -m venv /tmp/venv-gpuaot
    /tmp/venv-gpuaot/bin/pip install jax==0.10.2 jaxlib==0.10.2 flax optax chex
    /tmp/venv-gpuaot/bin/pip install --no-deps jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2
    JAX_PLATFORMS=cpu /tmp/venv-gpuaot/bin/python benchmarks/kernel_count.py

Each optimizer step (update + apply_updates, gradients given) of a 120-leaf model is compiled
with `jax.jit(...).trace(...).lower().compile()` for the target described by
`benchmarks/h100.txtpb`, and the kernel launches are read from XLA's thunk sequence (the list of
operations the GPU executable runs). Without the plugin, `run()` reports no rows and says why.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mpjax  # noqa: E402
from benchmarks.common import format_text  # noqa: E402

TARGET = Path(__file__).resolve().parent / "h100.txtpb"
KERNEL_KINDS = ("kKernel", "kCustomKernel")
TITLE = "GPU kernels per optimizer step (deviceless XLA:GPU compile for H100)"
COLUMNS = ["pattern", "params", "kernels", "other thunks", "vs optax.adam"]


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


def _count(step, init, params, grads, sharding, dump_dir) -> collections.Counter:
    def place(tree):
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree
        )

    opt_state = place(jax.eval_shape(init, params))
    grads, params = place(grads), place(params)
    lowered = jax.jit(step, donate_argnums=(0, 1)).trace(params, opt_state, grads).lower()
    lowered.compile(compiler_options={"xla_dump_to": dump_dir})
    [sequence] = Path(dump_dir).glob("*.thunk_sequence.txt")
    kinds = collections.Counter()
    for line in sequence.read_text().splitlines():
        if line.strip():
            kinds[line.split()[1]] += 1
    return kinds


def run(quick: bool = False) -> dict:
    """Counts kernels per step for each pattern; see the module docstring."""
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGET.read_text(), topology="1x1x1"
        )
    except Exception as e:  # the plugin is missing, or cannot describe the target
        return {
            "title": TITLE,
            "columns": COLUMNS,
            "rows": [],
            "notes": (
                "not run: deviceless CUDA compilation is unavailable here "
                f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); install the gpu-aot "
                "extra in a separate environment (see the module docstring)"
            ),
        }
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    n_blocks, width = (6, 64) if quick else (30, 256)
    f32 = _model(n_blocks, width, jnp.float32)
    bf16 = _model(n_blocks, width, jnp.bfloat16)
    n_leaves = len(jax.tree.leaves(f32))
    adam = optax.adam(1e-3)

    def carry_params(params):
        return (params, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))

    xla_scaled = mpjax.loss_scaled(adam, impl="xla")
    pallas_scaled = mpjax.loss_scaled(adam)  # default impl="auto": the Pallas kernel on CUDA
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
        ("mpjax.loss_scaled(adam, impl='xla')", "f32", _optax_step(xla_scaled), f32, f32),
        ("mpjax.loss_scaled(adam) (default, Pallas)", "f32", _optax_step(pallas_scaled), f32, f32),
        (
            "mpjax.loss_scaled(adam, impl='xla')",
            "bf16 + f32 master",
            _optax_step(xla_scaled),
            bf16,
            bf16,
        ),
        (
            "mpjax.loss_scaled(adam) (default, Pallas)",
            "bf16 + f32 master",
            _optax_step(pallas_scaled),
            bf16,
            bf16,
        ),
    ]
    rows = []
    baseline = None
    for name, params_kind, (step, init), params, grads in cases:
        with tempfile.TemporaryDirectory() as dump_dir:
            kinds = _count(step, init, params, grads, sharding, dump_dir)
        kernels = sum(kinds[k] for k in KERNEL_KINDS)
        others = sum(n for k, n in kinds.items() if k not in KERNEL_KINDS)
        baseline = baseline or kernels
        rows.append([name, params_kind, kernels, others, round(kernels / baseline, 2)])
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "notes": (
            f"{n_leaves}-leaf model ({n_blocks} blocks of a {width}x{width} kernel, bias, norm "
            "scale and bias); one optimizer step with gradients given (jit, params and state "
            "donated), compiled deviceless for benchmarks/h100.txtpb with jax "
            f"{jax.__version__}. kernels = kKernel + kCustomKernel thunks of XLA's thunk "
            "sequence (before command-buffer grouping); other thunks = copies, memsets etc. "
            "Target for the loss-scaled step: <= 130 kernels for 120 leaves."
        ),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 24-leaf model")
    print(format_text(run(quick=parser.parse_args().quick)))
