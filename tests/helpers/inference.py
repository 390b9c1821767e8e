"""Shared test helpers: inference."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mpjax.nn import ConvBN

TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def rel_err(y, ref):
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def reference64(model, variables, *inputs, **kwargs):
    """The original model run entirely in float64."""
    with jax.enable_x64(True):
        v64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), variables)
        x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in inputs]
        return np.asarray(jax.jit(functools.partial(model.apply, **kwargs))(v64, *x64), np.float64)


def randomize_stats(variables, seed):
    """Non-trivial BatchNorm statistics and affine parameters (and random everything else)."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        name = path[-1].key
        if name == "var":
            return jnp.asarray(rng.uniform(0.3, 3.0, x.shape), x.dtype)
        if name == "scale":
            return jnp.asarray(rng.uniform(0.5, 2.0, x.shape), x.dtype)
        if name in ("mean", "bias"):
            return jnp.asarray(rng.normal(0.0, 0.5, x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(leaf, variables)


class DenseBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        bn = functools.partial(nn.BatchNorm, use_running_average=not train)
        x = nn.relu(bn()(nn.Dense(32)(x)))
        x = nn.gelu(bn()(nn.Dense(32, use_bias=False)(x)))
        x = nn.LayerNorm()(x)
        return nn.Dense(3)(x)


class ConvBNNet(nn.Module):
    """mpjax.nn.ConvBN blocks: NCHW stem, a residual ConvBN, silu and linear ones."""

    impl: str = "auto"

    @nn.compact
    def __call__(self, x, train=False):
        cb = functools.partial(ConvBN, use_running_average=not train, impl=self.impl)
        x = cb(8, input_layout="NCHW")(x)
        y = cb(8)(x)
        x = cb(8, activation="silu")(y, residual=x)
        x = cb(8, activation="none")(x)
        return nn.Dense(3)(x.mean(axis=(1, 2)))
