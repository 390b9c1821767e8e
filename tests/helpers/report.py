"""Shared test helpers: the models and steps `mpjax.report` is checked on."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax

KEPT = "mid"  # the module a rule keeps in float32
D = 64  # multiples of 16: eligible for the GPU's tensor-core GEMMs


class RuleNet(nn.Module):
    """Dense -> relu -> Dense `mid` -> relu -> Conv -> Dense `head`."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(D)(x))
        x = nn.relu(nn.Dense(D, name=KEPT)(x))
        x = nn.Conv(D, (3,), name="conv")(x)
        return nn.Dense(D, name="head")(x)


def rule_model(compute: str = "bfloat16"):
    """`RuleNet` under a `compute` policy with `mid` kept float32 by a path rule."""
    spec = f"params=float32,compute={compute},output=float32"
    return mpjax.apply_policy(RuleNet(), {"*": spec, KEPT: "float32"})


def rule_step(compute: str = "bfloat16"):
    """(SGD train step, params, batch) of `rule_model`: forward, gradients, update."""
    model = rule_model(compute)
    x = jnp.linspace(-1.0, 1.0, 8 * 16 * D, dtype=jnp.float32).reshape(8, 16, D)
    params = model.init(jax.random.key(0), x)

    def step(params, x):
        def loss(p):
            return jnp.mean(jnp.square(model.apply(p, x)))

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, params, x


def gemm_counts(gemms) -> dict:
    """{module path: number of GEMMs} of report records."""
    out: dict = {}
    for g in gemms:
        out[g.path] = out.get(g.path, 0) + 1
    return out


def sharded_step(devices, batch: int = 32, d_in: int = 64, d_out: int = 128):
    """A data- and model-parallel step on a 2 x 4 mesh of `devices`; (step, params, x).

    The weight (float32, sharded on `model` by rows) is cast to bfloat16 and all-gathered;
    the batch is sharded on `data`; the weight gradient is all-reduced over `data`.
    """
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    w = jax.device_put(jnp.ones((d_in, d_out), jnp.float32), NamedSharding(mesh, P("model", None)))
    x = jax.device_put(jnp.ones((batch, d_in), jnp.float32), NamedSharding(mesh, P("data")))

    def step(w, x):
        def loss(w):
            y = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.grad(loss)(w)

    return step, w, x


def fp8_step(exclude: str = "*/head"):
    """(train step, variables, x) of `RuleNet` under bf16 with delayed fp8 for its Dense
    layers except `exclude` (the conv stays bf16); the step differentiates the fp8 meta too."""
    recipe = mpjax.Fp8Recipe(scaling="delayed", exclude=(exclude,))
    model = mpjax.apply_policy(RuleNet(), "params=float32,compute=bfloat16", fp8=recipe)
    x = jnp.linspace(-1.0, 1.0, 8 * 16 * D, dtype=jnp.float32).reshape(8, 16, D)
    variables = model.init(jax.random.key(0), x)

    def step(variables, x):
        def loss(v):
            return jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))

        return jax.grad(loss)(variables)

    return step, variables, x


def loss_scaled_step(compute: str = "float16"):
    """(plain training step, params, opt_state) of a small MLP under `mpjax.loss_scaled`.

    The step a user writes: policy-wrapped model, `scale_loss`, `tx.update`, `apply_updates`.
    """
    import optax

    model = mpjax.apply_policy(
        nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(1)]), f"p=f32,c={compute},o=f32"
    )
    x = jnp.linspace(-1.0, 1.0, 64 * 8, dtype=jnp.float32).reshape(64, 8)
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    params = model.init(jax.random.key(1), x)["params"]
    tx = mpjax.loss_scaled(optax.adam(1e-2))

    def step(params, opt_state):
        def loss_fn(p):
            loss = jnp.mean((model.apply({"params": p}, x) - y) ** 2)
            return mpjax.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, tx.init(params)
