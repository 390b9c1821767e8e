"""`quantize_orientations`: both copies of a tensor, each bit for bit `quantize_blocks` of the
oriented tensor; a block GEMM's value and gradients quantise each tensor once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.extend.core import jaxprs_in_params

import mpjax
from mpjax import Fp8Recipe
from mpjax._src.fp8.blocks import (
    block_shape,
    hash_uniform,
    quantize_with_blocks,
    row_major_index,
)
from mpjax._src.fp8.orientations import QUANTIZE_NAME
from mpjax.fp8 import (
    block_scaled_dot_general,
    quantize_blocks,
    quantize_orientations,
    random_hadamard,
)

SCALINGS = ("mxfp8", "nvfp4", "blockwise")
ROLES = ("activation", "weight", "gradient")


@functools.partial(jax.jit, static_argnames=("scaling", "axis", "role"))
def _quantize(x, scaling, axis, role):  # jitted like the reference: same rounding of x / s
    return quantize_blocks(x, scaling, axis=axis, role=role)


def _wide(shape, dtype, seed=0):
    """Normal values over ~40 binades by row, with an all-zero, an inf and a NaN block."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape) * jnp.exp2(
        jax.random.uniform(k2, (shape[0], 1), minval=-20, maxval=20)
    )
    x = x.at[:16, :40].set(0.0).at[20, 3].set(jnp.inf).at[shape[0] - 1, shape[1] - 2].set(jnp.nan)
    return x.astype(dtype)


def _bits(a):
    a = np.asarray(a.astype(jnp.float32) if a.dtype.itemsize < 2 else a, np.float32)
    return a.view(np.uint32)


def _assert_same(got, want):
    assert got.block == want.block
    for field in ("data", "scales"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.shape == w.shape and g.dtype == w.dtype, (field, g.shape, w.shape)
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=field)
    if want.tensor_scale is None:
        assert got.tensor_scale is None
    else:
        np.testing.assert_array_equal(_bits(got.tensor_scale), _bits(want.tensor_scale))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(160, 200), (37, 129)])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_each_copy_is_quantize_blocks_of_the_oriented_tensor(scaling, role, shape, dtype):
    x = _wide(shape, dtype)
    q = quantize_orientations(x, Fp8Recipe(scaling), role=role)
    _assert_same(q.rows, _quantize(x, scaling, 1, role))
    _assert_same(q.columns, _quantize(x.T, scaling, 1, role))


@pytest.mark.parametrize("rows", [True, False])
def test_nvfp4_hadamard_columns_with_a_seed_match_the_rotated_stochastic_copy(rows):
    x = _wide((48, 96), jnp.bfloat16, seed=3)
    seed = jnp.uint32(987654321)
    q = quantize_orientations(
        x, "nvfp4", role="gradient", rows=rows, column_hadamard=True, column_seed=seed
    )
    c = random_hadamard(x.T, 1)
    draws = hash_uniform(seed, row_major_index(c.shape))
    want = jax.jit(quantize_with_blocks, static_argnums=(1, 2))(
        c, "nvfp4", block_shape("nvfp4", 2, 1, "gradient"), False, draws
    )
    _assert_same(q.columns, want)
    assert (q.rows is not None) == rows


def _quantize_calls(jaxpr, counts):
    """Counts the named quantise calls of a jaxpr (and its sub-jaxprs) by the shape of the
    tensor quantised (its rows copy, the first output: every call here makes one). A call
    with no input (a constant JAX's scan partial evaluation made) reads no tensor."""
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == QUANTIZE_NAME:
            if not eqn.invars:
                continue
            shape = tuple(eqn.outvars[0].aval.shape)
            counts[shape] = counts.get(shape, 0) + 1
            continue
        for sub in jaxprs_in_params(eqn.params):
            _quantize_calls(sub, counts)
    return counts


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_block_gemm_step_quantises_each_tensor_once(scaling):
    # x [M, K], w [K, N] and the output gradient [M, N]: one quantise call each, making every
    # copy the three GEMMs read (forward, input gradient, weight gradient)
    m, k, n = 64, 96, 80
    x, w = jnp.ones((m, k)), jnp.ones((k, n))
    dims = (((1,), (0,)), ((), ()))

    def loss(x, w):
        out = block_scaled_dot_general(x, w, dims, Fp8Recipe(scaling), jnp.float32)
        return jnp.sum(out * out)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    assert _quantize_calls(jaxpr.jaxpr, {}) == {(m, k): 1, (k, n): 1, (m, n): 1}


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_orientations(jnp.ones((2, 3, 32)), "mxfp8")
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_orientations(jnp.ones((4, 32), jnp.int32), "mxfp8")
    with pytest.raises(ValueError, match="nothing to make"):
        quantize_orientations(jnp.ones((4, 32)), "mxfp8", rows=False, columns=False)
    with pytest.raises(ValueError, match="column_seed"):
        quantize_orientations(jnp.ones((4, 32)), "mxfp8", column_seed=jnp.uint32(1))
    with pytest.raises(ValueError, match="role"):
        quantize_orientations(jnp.ones((4, 32)), "mxfp8", role="bias")


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(128, use_bias=False)(x)), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return layers()(x, None)[0]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_scanned_layers_quantise_each_weight_once_per_step(scaling):
    # under nn.scan over layers the forward body quantises each layer's weight (both copies);
    # the backward body reads the kept copy: no weight-shaped quantise call in the backward
    model, x = _Scanned(), jnp.ones((64, 128))
    params = model.init(jax.random.key(0), x)
    recipe = Fp8Recipe(scaling, block_lowering="emulated")
    loss = mpjax.autocast(lambda p, x: jnp.sum(model.apply(p, x) ** 2), "float32", fp8=recipe)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
    calls = _quantize_calls(jaxpr.jaxpr, {})
    assert calls == {(64, 128): 2, (128, 128): 1}  # x and g of every layer; its weight once
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 2  # the forward and the backward loop
    forward, backward = (_quantize_calls(e.params["jaxpr"].jaxpr, {}) for e in scans)
    assert forward == {(64, 128): 1, (128, 128): 1} and backward == {(64, 128): 1}
