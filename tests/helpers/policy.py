"""Jaxpr inspection helpers shared by the per-module policy tests."""

import jax
import jax.numpy as jnp
import numpy as np

MATMULS = ("dot_general", "conv_general_dilated")


def _subjaxprs(value):
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if hasattr(item, "eqns"):
            yield item
        elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
            yield item.jaxpr


def walk(jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs (jit, custom_jvp, scan, remat, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from walk(sub)


def eqns(jaxpr, *names):
    return [e for e in walk(jaxpr) if e.primitive.name in names]


def in_dtypes(eqn):
    return tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))


def matmul_dtypes(jaxpr):
    """The operand dtypes of every dot_general / conv_general_dilated, in program order."""
    return [in_dtypes(e) for e in eqns(jaxpr, *MATMULS)]


def param_converts(closed, num_params):
    """For the first `num_params` jaxpr inputs: the dtypes each is converted to (top level)."""
    jaxpr = closed.jaxpr
    index = {v: i for i, v in enumerate(jaxpr.invars[:num_params])}
    out = [[] for _ in range(num_params)]
    for e in jaxpr.eqns:
        if e.primitive.name == "convert_element_type" and e.invars[0] in index:
            out[index[e.invars[0]]].append(jnp.dtype(e.params["new_dtype"]))
    return out


def paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def rel_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# Relative error bounds against a float64 reference, by compute dtype.
TOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}
