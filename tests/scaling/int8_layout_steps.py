"""The FSDP AdamW step with bf16 or int8 state built three ways, and its collectives.

Shared by `tests/scaling/test_int8_layout_sharding.py` (8 simulated CPU devices) and
`tests/scaling/_int8_layout_hlo.py` (the 8-GPU deviceless compile, under the gpu-aot python).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.analysis.collectives import collectives
from mpjax.scaling import Blockwise8

# leaf -> (shape, its split over the mesh axis "fsdp" of 8): on its last axis, first, none
SPECS = {
    "last": ((16, 1000), P(None, "fsdp")),
    "wide": ((4, 4096), P(None, "fsdp")),
    "rows": ((64, 768), P("fsdp", None)),
    "rep": ((5, 300), P()),
    "b": ((3,), P()),
}
WAYS = ("eager", "eval_shape", "jit_out_shardings")
is_q = lambda x: isinstance(x, Blockwise8)  # noqa: E731


def tx(dtype) -> optax.GradientTransformation:
    return mpjax.low_precision_state(optax.adamw(1e-3), dtype)


def abstract_params(mesh) -> dict:
    return {
        k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        for k, (shape, spec) in SPECS.items()
    }


def state_shardings(abstract_state, mesh):
    """Each moment split like its param (an int8 leaf's scales like its codes), the rest
    replicated: the rule a user derives from `jax.eval_shape(tx.init, params)`."""
    by_shape = {shape: spec for shape, spec in SPECS.values()}

    def one(x):
        if is_q(x):
            spec = by_shape[x.codes.shape]
            return Blockwise8(NamedSharding(mesh, spec), NamedSharding(mesh, spec))
        return NamedSharding(mesh, by_shape.get(x.shape, P()))

    return jax.tree.map(one, abstract_state, is_leaf=is_q)


def built_state(dtype, way: str, params, mesh):
    """The optimizer state (arrays, or abstract with shardings) built `way`."""
    t = tx(dtype)
    if way == "eager":  # its scalars (the counts) come on one device: replicate them
        rep = NamedSharding(mesh, P())
        return jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, rep), t.init(params))
    shardings = state_shardings(jax.eval_shape(t.init, params), mesh)
    if way == "eval_shape":
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(t.init, params),
            shardings,
        )
    return jax.jit(t.init, out_shardings=shardings)(params)


def step_collectives(dtype, params, state) -> list:
    """(op, dtype, bytes) of each collective of the compiled update step."""
    t = tx(dtype)

    def step(p, s, g):
        updates, s = t.update(g, s, p)
        return optax.apply_updates(p, updates), s

    shardings = jax.tree.map(lambda x: x.sharding, (params, state))
    lowered = jax.jit(step, in_shardings=(*shardings, shardings[0]), out_shardings=shardings)
    compiled = lowered.lower(params, state, params).compile()
    return sorted((c.op, c.dtype, c.bytes) for c in collectives(compiled.as_text()))


def real_params(mesh) -> dict:
    rng = np.random.default_rng(0)
    return {
        k: jax.device_put(rng.normal(size=x.shape).astype(np.float32), x.sharding)
        for k, x in abstract_params(mesh).items()
    }
