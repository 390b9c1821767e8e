"""Shared test helpers: numerics."""

import jax
import jax.numpy as jnp
import numpy as np


def tree_rel_err(tree, ref):
    """Largest per-leaf relative error; a leaf whose true value is ~0 (the key bias of
    attention has a vanishing gradient) is measured against the whole tree's norm."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
    refs = [np.asarray(r, np.float64) for r in jax.tree.leaves(ref)]
    total = np.sqrt(sum(np.sum(r**2) for r in refs))
    scale = [np.linalg.norm(r) if np.linalg.norm(r) > 1e-6 * total else total for r in refs]
    return max(
        float(np.linalg.norm(x - r) / d) for x, r, d in zip(leaves, refs, scale, strict=True)
    )


def f64_reference(fn, *args):
    """`fn(*args)` evaluated (jitted) in float64, floating leaves of `args` upcast."""
    with jax.enable_x64(True):
        args64 = jax.tree.map(
            lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
            args,
        )
        return jax.tree.map(np.asarray, jax.jit(fn)(*args64))
