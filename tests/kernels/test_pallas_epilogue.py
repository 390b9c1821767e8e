"""mpjax.pallas.conv_epilogue: interpret-mode kernels (forward and custom_vjp backward) vs the
jnp reference vs float64, on ragged multi-block shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from mpjax._src.kernels import common
from mpjax._src.kernels.epilogue import conv_epilogue_reference
from mpjax.pallas import conv_epilogue

# (N, H, W, C): 72 rows in 5 row blocks of 16 (the last ragged) x 2 channel blocks of 256
# (the last 44 wide): every kernel masks both axes.
SHAPE = (1, 9, 8, 300)
SMALL = (2, 3, 5, 6)  # one ragged 32 x 8 tile

# Each dtype meets each activation, with and without a residual, in 9 cases.
CASES = [
    (jnp.float32, "relu", True),
    (jnp.float32, "silu", False),
    (jnp.float32, "none", True),
    (jnp.bfloat16, "relu", True),
    (jnp.bfloat16, "silu", True),
    (jnp.bfloat16, "none", False),
    (jnp.float16, "relu", False),
    (jnp.float16, "silu", True),
    (jnp.float16, "none", True),
]
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _inputs(seed, shape, dtype, residual):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    y = jnp.asarray(rng.standard_normal(shape), dtype)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, c) * rng.choice([-1, 1], c), jnp.float32)
    shift = jnp.asarray(rng.standard_normal(c) * 0.5, jnp.float32)
    res = jnp.asarray(rng.standard_normal(shape), dtype) if residual else None
    cot = jnp.asarray(rng.standard_normal(shape), dtype)
    return y, scale, shift, res, cot


def _act64(z, activation):
    """act(z), act'(z), and the magnitude of the terms of act'(z) (they cancel for silu)."""
    if activation == "relu":
        d = (z > 0).astype(np.float64)
        return np.maximum(z, 0), d, d
    if activation == "silu":
        s = 1 / (1 + np.exp(-z))
        return z * s, s * (1 + z * (1 - s)), s + np.abs(z) * s * (1 - s)
    return z, np.ones_like(z), np.ones_like(z)


def _reference64(y, scale, shift, res, cot, activation):
    """float64 numpy: the output, and the gradients of sum(out * cot)."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)
    y, scale, shift, res, cot = map(f, (y, scale, shift, res, cot))
    z = y * scale + shift + (0 if res is None else res)
    out, dact, dact_mag = _act64(z, activation)
    dz = cot * dact
    axes = tuple(range(y.ndim - 1))
    grads = {
        "y": dz * scale,
        "scale": (dz * y).sum(axes),
        "shift": dz.sum(axes),
        "res": dz,
    }
    # Magnitudes of the terms behind each result, to judge rounding where terms cancel: z is
    # a sum of three terms; act'(z) of two for silu (and |act''| <= 1 carries z's error).
    terms = np.abs(y * scale) + np.abs(shift) + (0 if res is None else np.abs(res))
    dz_mag = np.abs(cot) * (dact_mag + (activation == "silu") * terms)
    mags = {
        "out": np.abs(dact) * terms + np.abs(out),
        "y": dz_mag * np.abs(scale),
        "res": dz_mag,
        "scale": (dz_mag * np.abs(y)).sum(axes),
        "shift": dz_mag.sum(axes),
    }
    return out, grads, mags


@functools.partial(jax.jit, static_argnames=("activation", "impl", "out_dtype"))
def _forward_and_grads(y, scale, shift, res, cot, *, activation, impl, out_dtype=None):
    def f(y, scale, shift, res):
        return conv_epilogue(
            y, scale, shift, res, activation=activation, out_dtype=out_dtype, impl=impl
        )

    out, vjp = jax.vjp(f, y, scale, shift, res)
    return out, dict(zip(("y", "scale", "shift", "res"), vjp(cot.astype(out.dtype)), strict=True))


def _assert_rel(got, want, rtol, mag=None):
    got = np.asarray(got, np.float64)
    denom = np.maximum(np.abs(want) if mag is None else mag, 1e-30)
    err = np.max(np.abs(got - want) / np.maximum(denom, np.finfo(np.float32).tiny))
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("dtype,activation,residual", CASES)
def test_forward_and_backward_match_reference_and_float64(dtype, activation, residual):
    y, scale, shift, res, cot = _inputs(0, SHAPE, dtype, residual)
    out, grads = _forward_and_grads(
        y, scale, shift, res, cot, activation=activation, impl="interpret"
    )
    xout, xgrads = _forward_and_grads(y, scale, shift, res, cot, activation=activation, impl="xla")
    ref_out, ref_grads, mags = _reference64(y, scale, shift, res, cot, activation)

    assert out.dtype == dtype and out.shape == SHAPE
    assert grads["y"].dtype == dtype and grads["scale"].dtype == jnp.float32
    tol = TOL[dtype]
    # Output: equal to the jnp reference up to one rounding of the output dtype.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xout, np.float32), rtol=tol)
    _assert_rel(out, ref_out, tol, mag=mags["out"])
    if dtype != jnp.float32:
        # Half-precision input gradients equal the jnp reference's: the same float32 math,
        # rounded once to the input dtype.
        np.testing.assert_array_equal(grads["y"], xgrads["y"])
        if residual:
            np.testing.assert_array_equal(grads["res"], xgrads["res"])
    for name in ("y", "res") if residual else ("y",):
        _assert_rel(grads[name], ref_grads[name], tol, mag=mags[name])
        np.testing.assert_allclose(
            np.asarray(grads[name], np.float32), np.asarray(xgrads[name], np.float32), rtol=tol
        )
    # Per-channel reductions, in float32 whatever the input dtype.
    for name in ("scale", "shift"):
        _assert_rel(grads[name], ref_grads[name], 1e-5, mag=mags[name])
        _assert_rel(grads[name], np.asarray(xgrads[name], np.float64), 1e-5, mag=mags[name])
    if not residual:
        assert grads["res"] is None


def test_backward_loops_over_row_groups(monkeypatch):
    # Production allows 512 row groups; 2 makes each program loop over 3 row blocks.
    monkeypatch.setattr(common, "MAX_ROW_GROUPS", 2)
    assert common.row_groups(72, 16) == (2, 3)
    y, scale, shift, res, cot = _inputs(1, SHAPE, jnp.bfloat16, True)
    fn = jax.jit(_forward_and_grads.__wrapped__, static_argnames=("activation", "impl"))
    _, grads = fn(y, scale, shift, res, cot, activation="silu", impl="interpret")
    _, ref_grads, mags = _reference64(y, scale, shift, res, cot, "silu")
    _, xgrads = _forward_and_grads(y, scale, shift, res, cot, activation="silu", impl="xla")
    np.testing.assert_array_equal(grads["y"], xgrads["y"])
    for name in ("scale", "shift"):
        _assert_rel(grads[name], ref_grads[name], 1e-5, mag=mags[name])


@pytest.mark.parametrize(
    "y_dtype,out_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float16)]
)
def test_out_dtype_and_non_finite_inputs(y_dtype, out_dtype):
    y, scale, shift, res, cot = _inputs(2, SMALL, y_dtype, True)
    flat = y.reshape(-1)
    y = flat.at[0].set(jnp.inf).at[flat.size // 2].set(jnp.nan).at[-1].set(-jnp.inf).reshape(SMALL)
    kw = dict(activation="relu", out_dtype=out_dtype)
    out, grads = _forward_and_grads(y, scale, shift, res, cot, impl="interpret", **kw)
    xout, xgrads = _forward_and_grads(y, scale, shift, res, cot, impl="xla", **kw)
    assert out.dtype == out_dtype and grads["y"].dtype == y_dtype
    # inf/NaN land where the reference puts them (same places and signs); the finite values
    # agree to one float32 rounding of the summed terms (|terms| < 8: 1e-6): jaxlib 0.12's
    # XLA:CPU rounds the jitted reference differently from 0.10 (7 of 180 values by an ulp)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_array_equal(np.isfinite(f32(out)), np.isfinite(f32(xout)))
    np.testing.assert_allclose(f32(out), f32(xout), rtol=2.5e-7, atol=1e-6, equal_nan=True)
    assert not np.isfinite(np.asarray(out, np.float32).reshape(-1)[flat.size // 2])
    np.testing.assert_array_equal(grads["res"], xgrads["res"])


def _away_from_kinks(seed, shape, residual):
    """float64 inputs whose pre-activation stays >= 0.1 away from relu's kink."""
    rng = np.random.default_rng(seed)
    c = shape[-1]
    scale = rng.uniform(0.5, 2.0, c)
    shift = rng.standard_normal(c) * 0.5
    res = rng.standard_normal(shape) if residual else None
    z = rng.uniform(0.1, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    y = (z - shift - (0 if res is None else res)) / scale
    return y, scale, shift, res


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("activation", ["relu", "silu", "none"])
def test_check_grads_float64(impl, activation):
    with jax.enable_x64(True):
        y, scale, shift, res = _away_from_kinks(3, SMALL, residual=True)
        f = jax.jit(
            lambda y, scale, shift, res: conv_epilogue(
                y, scale, shift, res, activation=activation, impl=impl
            )
        )
        args = tuple(jnp.asarray(a, jnp.float64) for a in (y, scale, shift, res))
        assert f(*args).dtype == jnp.float64
        check_grads(f, args, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_auto_on_cpu_is_the_reference():
    y, scale, shift, res, cot = _inputs(4, SMALL, jnp.bfloat16, True)
    out, grads = _forward_and_grads(y, scale, shift, res, cot, activation="silu", impl="auto")
    xout, xgrads = _forward_and_grads(y, scale, shift, res, cot, activation="silu", impl="xla")
    np.testing.assert_array_equal(out, xout)
    for k in grads:
        np.testing.assert_array_equal(grads[k], xgrads[k])


def test_without_jit():
    y, scale, shift, res, _ = _inputs(5, SMALL, jnp.float16, True)
    out = conv_epilogue(y, scale, shift, res, activation="none", impl="interpret")
    xout = jax.jit(functools.partial(conv_epilogue, activation="none", impl="xla"))(
        y, scale, shift, res
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xout, np.float32), rtol=2e-3)


def test_bad_input_is_named():
    y = jnp.ones((2, 3, 3, 4))
    v = jnp.ones(4)
    with pytest.raises(ValueError, match="scale has 5 channels, expected 4"):
        conv_epilogue(y, jnp.ones(5), v)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 3, 3, 5\)"):
        conv_epilogue(y, v, v, jnp.ones((2, 3, 3, 5)))
    with pytest.raises(ValueError, match="activation must be one of"):
        conv_epilogue(y, v, v, activation="gelu")
    with pytest.raises(TypeError, match="y must be floating"):
        conv_epilogue(jnp.ones((2, 4), jnp.int32), v, v)
    with pytest.raises(TypeError, match="out_dtype must be floating"):
        conv_epilogue(y, v, v, out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="impl must be one of"):
        conv_epilogue(y, v, v, impl="cuda")
    with pytest.raises(ValueError, match="cannot run on these inputs"):
        conv_epilogue(jnp.ones((0, 4)), v, v, impl="interpret")
    assert conv_epilogue(jnp.ones((0, 4)), v, v, impl="auto").shape == (0, 4)


def test_xla_epilogue_saves_no_float32_copy_for_the_backward_pass():
    """Under bf16 the reference keeps what it saves for the gradient in bf16 (no f32 z)."""
    y = jax.random.normal(jax.random.key(0), (64, 8), jnp.bfloat16)
    scale, shift = jnp.full((8,), 1.5), jnp.full((8,), -0.25)

    def f(y, res):
        return conv_epilogue_reference(y, scale, shift, res, activation="relu")

    _, vjp_fn = jax.vjp(f, y, y)
    saved = [x for x in jax.tree.leaves(vjp_fn) if np.shape(x) == y.shape]  # the residuals
    assert saved and all(x.dtype != jnp.float32 for x in saved), [x.dtype for x in saved]


def test_xla_relu_mask_reads_the_pinned_output():
    """The relu's backward mask reads the layer output (materialised), not the pre-activation.

    With the mask taken from the pre-activation, XLA:GPU keeps that pre-activation as a second
    activation-sized buffer per residual block until the backward pass (ResNet-50 ConvBN:
    1.045x the temp memory of the Flax bf16 model on the H100 cost model).
    """
    y = jax.random.normal(jax.random.key(1), (64, 8), jnp.bfloat16)
    scale, shift = jnp.full((8,), 1.5), jnp.full((8,), -0.25)

    def loss(y, res):
        out = conv_epilogue(y, scale, shift, res, activation="relu", impl="xla")
        return jnp.sum(out.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(y, y).jaxpr
    producer = {}

    def visit(jpr):
        for eqn in jpr.eqns:
            for out in eqn.outvars:
                producer[out] = eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr)
    masks = [e for e in producer.values() if e.primitive.name == "gt"]
    assert masks, "no relu mask in the jvp"
    for mask in masks:
        source = producer.get(mask.invars[0])
        assert source is not None and source.primitive.name == "optimization_barrier", (
            f"the relu mask reads {source.primitive.name if source else 'an input'}"
        )
