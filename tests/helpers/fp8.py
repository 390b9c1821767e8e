"""Shared test helpers: fp8."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params

from mpjax import Fp8Recipe

TOL_E4M3, TOL_E5M2 = 0.05, 0.09
E4, E5 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
MAX = {"x": 448.0, "w": 448.0, "g": 57344.0}


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def wide(rng, shape, spread=3.0):
    """Normal values with per-row magnitudes e**-spread .. e**spread."""
    return (
        rng.standard_normal(shape)
        * np.exp(rng.uniform(-spread, spread, shape[:1] + (1,) * (len(shape) - 1)))
    ).astype(np.float32)


def f64_grads(fn, *args):
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), list(args))
        return jax.tree.map(np.asarray, jax.value_and_grad(fn, range(len(args)))(*args64))


def gemm_operand_dtypes(fn, *args):
    """Operand dtypes of every dot_general in the jaxpr of `fn` (recursing into sub-jaxprs)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(
                    tuple(np.dtype(v.aval.dtype) for v in eqn.invars if not isinstance(v, Literal))
                )
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


F32 = "params=float32,compute=float32,output=float32"


BF16 = "params=float32,compute=bfloat16,output=float32"


def delayed(**kw):
    return Fp8Recipe(scaling="delayed", **kw)


def _numpy_reference(amaxes, length, compute, margin):
    """History (newest first) and scales after each step, in float64."""
    history, scale, out = np.zeros((3, length)), np.ones(3), []
    for seen in amaxes:
        finite = np.isfinite(seen)
        history[finite] = np.concatenate([seen[finite, None], history[finite, :-1]], axis=1)
        reduced = history.max(axis=1) if compute == "max" else history[:, 0]
        fmax = np.array([MAX["x"], MAX["w"], MAX["g"]])
        fresh = fmax / np.where(reduced > 0, reduced, 1.0) / 2.0**margin
        scale = np.where(reduced > 0, fresh, scale)
        out.append((history.copy(), scale.copy()))
    return out


def bf16_amax(x):
    """max |x| after the policy's cast of the input to bfloat16."""
    return np.float32(jnp.asarray(np.abs(x).max(), jnp.bfloat16))


def _per_device_inputs(rng, n):
    """Device i's rows scaled by 10**i: every device sees a different amax."""
    x = wide(rng, (n, 16, 64), 1.0)
    return x * (10.0 ** np.arange(n, dtype=np.float32))[:, None, None]


def _nan_grad(where):
    """Identity whose backward puts NaN into the activation gradient at `where` (None: none)."""

    @jax.custom_vjp
    def ident(h):
        return h

    def bwd(_, g):
        if where is None:
            return (g,)
        return (g.reshape(-1).at[where].set(jnp.nan).reshape(g.shape),)

    ident.defvjp(lambda h: (h, None), bwd)
    return ident


def quantize_shapes(jaxpr, counts=None, inside=None):
    """{shape of the quantised tensor: count} of the named quantise calls of a jaxpr and its
    sub-jaxprs; `inside`: only those under an equation of that primitive."""
    from mpjax._src.fp8.orientations import QUANTIZE_NAME

    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == QUANTIZE_NAME and eqn.invars and inside is None:
            shape = tuple(eqn.invars[0].aval.shape)
            counts[shape] = counts.get(shape, 0) + 1
            continue
        below = None if inside == eqn.primitive.name else inside
        for sub in jaxprs_in_params(eqn.params):
            quantize_shapes(sub, counts, below)
    return counts


def named_calls(jaxpr, name: str) -> int:
    """How many times the equations named `name` run in a jaxpr: each call site of a
    sub-jaxpr counted (a jitted function called twice is one shared jaxpr, two calls)."""
    return sum(
        (eqn.params.get("name") == name)
        + sum(named_calls(sub, name) for sub in jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_equal_trees(got, want):
    """Every leaf of `got` equals `want`'s bit for bit (fp8 leaves compared as bytes)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
