"""Shared helpers of the sharding tests: meshes on 8 CPU devices, a tensor-parallel MLP, checks.

The MLP's weights are sharded over their output columns, so the activations between the GEMMs
are sharded over features and the second GEMM gathers them (`SPECS`); under `jax.shard_map`
the second weight is sharded over its rows and its GEMM's partial products are summed with
`psum` (`SHARD_MAP_SPECS`). The same code runs unsharded (no mesh): the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "d"
N_DEV = 8
D, H = 16, 32  # multiples of 16: the fp8 paths take these GEMMs (with min_dim=16)
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
# Specs of the MLP's params and input: columns, then rows of the two GEMMs.
SPECS = {"w1": P(None, AXIS), "b1": P(AXIS), "w2": P(None, AXIS), "b2": P(AXIS)}
SHARD_MAP_SPECS = {"w1": P(None, AXIS), "b1": P(AXIS), "w2": P(AXIS, None), "b2": P()}
X_SPEC = P()


def make_mesh(kind: str) -> jax.sharding.Mesh:
    """A 1-D mesh of the 8 devices with Explicit or Auto axes."""
    return jax.make_mesh((N_DEV,), (AXIS,), axis_types=(AXIS_TYPES[kind],))


def place(tree, specs, mesh):
    """`tree` put on `mesh` with `specs` (a matching tree of PartitionSpecs)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def mlp_params(dtype=jnp.float32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"w1": (D, H), "b1": (H,), "w2": (H, D), "b2": (D,)}
    return {
        k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype) for k, s in shapes.items()
    }


def mlp_input(seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((D, D)), jnp.float32)


def mlp_loss(params: dict, x: jax.Array) -> jax.Array:
    """GEMMs, custom-JVP activations, a constant mask (`jnp.where`'s nested jit), softmax."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = jnp.where(h > -0.1, h, -1e9)
    h = jax.nn.relu(h) + jax.nn.softmax(h)
    y = h @ params["w2"] + params["b2"]
    return jnp.mean(jnp.square(y - 1.0))


def on_mesh(fun, kind: str | None, args, specs):
    """`jax.jit(fun)(*args)`: unsharded for `kind=None`, else with `args` placed by `specs`
    on an 8-device mesh of that axis type, under `jax.set_mesh`. Returns host values."""
    if kind is None:
        return jax.device_get(jax.jit(fun)(*args))
    mesh = make_mesh(kind)
    with jax.set_mesh(mesh):
        return jax.device_get(jax.jit(fun)(*place(args, specs, mesh)))


def assert_trees_close(got, want, tol: float, what: str = "") -> None:
    """Same structure, dtypes and shapes; each floating leaf within `tol` of `want` in the
    relative Frobenius norm (float64); other leaves equal."""
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
    w_leaves, w_def = jax.tree.flatten(want)
    assert g_def == w_def, f"{what}: structures differ: {g_def} vs {w_def}"
    for (path, g), w in zip(g_leaves, w_leaves, strict=True):
        name = f"{what}{jax.tree_util.keystr(path)}"
        g, w = np.asarray(g), np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (
            f"{name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        )
        if not jnp.issubdtype(w.dtype, jnp.floating):
            np.testing.assert_array_equal(g, w, err_msg=name)
            continue
        g, w = g.astype(np.float64), w.astype(np.float64)
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"
