"""fp8 convolutions: 1x1 convs as fp8 GEMMs under autocast, the documented fallback, `fp8_ops`."""

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpjax
from mpjax import Fp8Recipe
from mpjax._src.fp8.conv import CONV_FALLBACK
from mpjax.fp8 import fp8_conv_1x1, fp8_ops
from tests.helpers.fp8 import TOL_E4M3, TOL_E5M2, f64_grads, gemm_operand_dtypes, rel_err, wide
from tests.helpers.policy import eqns

E4, E5 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
BF16 = np.dtype(jnp.bfloat16)
POLICY = "params=float32,compute=bfloat16,output=float32"
NHWC = ("NHWC", "HWIO", "NHWC")
FP8_GEMMS = Counter({(E4, E4): 1, (E5, E4): 1, (E4, E5): 1})  # forward, d input, d weight


def conv(x, w, stride=1, dn=NHWC, padding="VALID"):
    return lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=dn)


def conv_operand_dtypes(fn, *args):
    return [
        tuple(np.dtype(v.aval.dtype) for v in e.invars)
        for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr, "conv_general_dilated")
    ]


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize(
    "stride,dn,x_shape,w_shape",
    [
        (1, NHWC, (8, 6, 6, 64), (1, 1, 64, 48)),
        (2, NHWC, (8, 7, 7, 64), (1, 1, 64, 48)),  # odd size: 4x4 output pixels
        (2, ("NCHW", "OIHW", "NCHW"), (8, 64, 8, 8), (48, 64, 1, 1)),  # other layouts
    ],
)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_1x1_conv_gradients_vs_float64(stride, dn, x_shape, w_shape, scaling):
    """Output within e4m3's and input/weight gradients within e5m2's stated tolerance."""
    rng = np.random.default_rng(stride)
    x = wide(rng, x_shape)  # per-image magnitudes e**-3 .. e**3
    w = (rng.standard_normal(w_shape) * np.exp(rng.uniform(-2, 2, w_shape))).astype(np.float32)
    out_shape = jax.eval_shape(lambda a, b: conv(a, b, stride, dn), x, w).shape
    r = wide(rng, out_shape)  # the output gradient, wide range too
    ref_fn = lambda a, b: jnp.sum(conv(a, b, stride, dn) * r)  # noqa: E731
    f8 = mpjax.autocast(
        lambda a, b: jnp.sum(conv(a, b, stride, dn).astype(jnp.float32) * r),
        POLICY,
        fp8=Fp8Recipe(scaling=scaling, min_dim=16, convs="1x1"),
    )
    gx, gw = jax.jit(jax.grad(f8, (0, 1)))(x, w)
    _, (rx, rw) = f64_grads(ref_fn, x, w)
    assert gx.dtype == jnp.float32 and gw.dtype == jnp.float32
    assert rel_err(gx, rx) < TOL_E5M2 and rel_err(gw, rw) < TOL_E5M2
    rec = Fp8Recipe(min_dim=16, convs="1x1")
    out = mpjax.autocast(lambda a, b: conv(a, b, stride, dn), POLICY, fp8=rec)
    with jax.enable_x64(True):
        ref_out = conv(x.astype(np.float64), w.astype(np.float64), stride, dn)
    assert rel_err(out(x, w), ref_out) < TOL_E4M3
    # it really ran as fp8 GEMMs, forward and both gradients, and as no convolution
    assert Counter(gemm_operand_dtypes(jax.grad(f8, (0, 1)), x, w)) == FP8_GEMMS
    assert conv_operand_dtypes(jax.grad(f8, (0, 1)), x, w) == []


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_makes_the_fp8_conv_output_non_finite(where, bad):
    rng = np.random.default_rng(7)
    x, w = wide(rng, (4, 4, 4, 32)), rng.standard_normal((1, 1, 32, 32)).astype(np.float32)
    flat = x.reshape(-1)
    flat[{"first": 0, "middle": flat.size // 2, "last": -1}[where]] = bad
    f = mpjax.autocast(conv, POLICY, fp8=Fp8Recipe(min_dim=16, convs="1x1"))
    assert not np.isfinite(np.asarray(f(x, w))).all()  # never a silently finite output


# ----------------------------------------------------------------------------- autocast


class Bottleneck(nn.Module):
    """ResNet-style: 1x1 reduce, 3x3, 1x1 expand, a 7x7 stem; channels multiples of 16."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), (2, 2), name="stem")(x)
        h = nn.relu(nn.Conv(32, (1, 1), name="reduce")(x))
        h = nn.relu(nn.Conv(32, (3, 3), name="conv3x3")(h))
        return x + nn.Conv(64, (1, 1), name="expand")(h)


def bottleneck_setup():
    rng = np.random.default_rng(0)
    x = wide(rng, (4, 16, 16, 3), 2.0)
    model = Bottleneck()
    return model, model.init(jax.random.key(0), x), x


def test_autocast_runs_1x1_convs_as_fp8_gemms_and_the_others_in_bf16():
    model, params, x = bottleneck_setup()
    f8 = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe(min_dim=32, convs="1x1"))
    # forward: the two 1x1 convs are e4m3 GEMMs; the 7x7 and 3x3 convs bf16 convolutions
    assert gemm_operand_dtypes(f8, params, x) == [(E4, E4), (E4, E4)]
    assert conv_operand_dtypes(f8, params, x) == [(BF16, BF16)] * 2
    # backward: each 1x1 conv's two gradient GEMMs are fp8 too; no fp8 convolution anywhere
    loss = lambda p: jnp.mean(f8(p, x) ** 2)  # noqa: E731
    assert Counter(gemm_operand_dtypes(jax.grad(loss), params)) == FP8_GEMMS + FP8_GEMMS
    assert {d for d in conv_operand_dtypes(jax.grad(loss), params)} == {(BF16, BF16)}

    grads = jax.jit(jax.grad(loss))(params)
    _, (ref,) = f64_grads(lambda p: jnp.mean(model.apply(p, x) ** 2), params)
    for path in (("reduce", "kernel"), ("expand", "kernel"), ("conv3x3", "kernel")):
        g, r = grads["params"][path[0]][path[1]], ref["params"][path[0]][path[1]]
        assert rel_err(g, r) < 2 * TOL_E5M2, path  # fp8 layers back to back


def test_default_recipe_keeps_every_conv_in_the_compute_dtype():
    """convs="none" is the default: fp8 1x1 convs do not pay on ResNet-50 (the cost model)."""
    assert Fp8Recipe().convs == "none"
    model, params, x = bottleneck_setup()
    f8 = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe(min_dim=32))
    loss = lambda p: jnp.mean(f8(p, x) ** 2)  # noqa: E731
    assert gemm_operand_dtypes(jax.grad(loss), params) == []
    assert {d for d in conv_operand_dtypes(jax.grad(loss), params)} == {(BF16, BF16)}


def test_exclusions_see_a_1x1_conv_as_a_conv_site():
    model, params, x = bottleneck_setup()
    sites = []

    def record(site):
        sites.append(site)
        return site.kind == "conv" and site.name.endswith("expand")

    rec = Fp8Recipe(min_dim=32, convs="1x1", exclude_if=record)
    f8 = mpjax.autocast(model.apply, POLICY, fp8=rec)
    assert gemm_operand_dtypes(f8, params, x) == [(E4, E4)]  # `reduce` only
    assert [(s.kind, s.lhs_shape, s.rhs_shape) for s in sites] == [
        ("conv", (4 * 8 * 8, 64), (64, 32)),  # [N*H*W, C_in] x [C_in, C_out]
        ("conv", (4 * 8 * 8, 32), (32, 64)),
    ]
    rec = Fp8Recipe(min_dim=32, convs="1x1", exclude="*/reduce")
    by_path = mpjax.autocast(model.apply, POLICY, fp8=rec)
    assert gemm_operand_dtypes(by_path, params, x) == [(E4, E4)]  # `expand` only


# ----------------------------------------------------------------------------- fp8_ops, errors


def test_fp8_ops_reports_each_choice_as_autocast_makes_it():
    model, params, x = bottleneck_setup()
    recipe = Fp8Recipe(min_dim=32, convs="1x1")
    ops = fp8_ops(model.apply, recipe, params, x)
    assert [(op.name.split("/")[-1], op.fp8) for op in ops] == [
        ("stem", False),
        ("reduce", True),
        ("conv3x3", False),
        ("expand", True),
    ]
    assert ops[0].reason == ops[2].reason == CONV_FALLBACK
    assert "weight-gradient" in CONV_FALLBACK and ops[1].reason == ""
    assert ops[1].lhs_shape == (4, 8, 8, 64) and ops[1].rhs_shape == (1, 1, 64, 32)
    # the report agrees with the program autocast emits
    f8 = mpjax.autocast(model.apply, POLICY, fp8=recipe)
    assert sum(op.fp8 for op in ops) == len(gemm_operand_dtypes(f8, params, x))
    none = fp8_ops(model.apply, Fp8Recipe(min_dim=32), params, x)  # the default: convs="none"
    assert not any(op.fp8 for op in none) and "convs='none'" in none[1].reason
    small = fp8_ops(model.apply, Fp8Recipe(min_dim=128, convs="1x1"), params, x)
    assert "min_dim" in small[1].reason and not small[1].fp8


def test_fp8_ops_on_dense_and_attention_products():
    a, w = jnp.ones((64, 128)), jnp.ones((128, 64))
    q = jnp.ones((2, 64, 64))

    def f(a, w, q):
        return a @ w, jnp.einsum("bij,bkj->bik", q, q), a[:, :10] @ w[:10]

    ops = fp8_ops(f, Fp8Recipe(), a, w, q)
    assert [op.fp8 for op in ops] == [True, False, False]
    assert "batched" in ops[1].reason and "multiples of 16" in ops[2].reason
    excluded = fp8_ops(f, Fp8Recipe(exclude_if=lambda s: s.kind == "dot_general"), a, w, q)
    assert "excluded" in excluded[0].reason


def test_bad_input_names_the_culprit():
    with pytest.raises(ValueError, match="convs="):
        Fp8Recipe(convs="all")
    with pytest.raises(TypeError, match="Fp8Recipe"):
        fp8_ops(lambda x: x, "tensorwise", jnp.ones(3))
    dn = lax.conv_dimension_numbers((2, 8, 8, 16), (3, 3, 16, 16), NHWC)
    params = dict(
        window_strides=(1, 1),
        padding=((1, 1), (1, 1)),
        lhs_dilation=(1, 1),
        dimension_numbers=dn,
        feature_group_count=1,
        batch_group_count=1,
    )
    with pytest.raises(ValueError, match="weight-gradient"):
        fp8_conv_1x1(jnp.ones((2, 8, 8, 16)), jnp.ones((3, 3, 16, 16)), params, Fp8Recipe(), BF16)
    padded = dict(params, padding=((1, 1), (1, 1)))
    with pytest.raises(ValueError, match="padded"):
        fp8_conv_1x1(jnp.ones((2, 8, 8, 16)), jnp.ones((1, 1, 16, 16)), padded, Fp8Recipe(), BF16)
