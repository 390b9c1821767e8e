"""mpjax.nn.ConvBN against flax.linen Conv + BatchNorm + residual + activation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax.nn import ConvBN, nchw_to_nhwc

ACT = {"relu": nn.relu, "silu": nn.silu, "none": lambda x: x}


class FlaxConvBN(nn.Module):
    """The unfused Flax layers ConvBN stands for."""

    features: int
    activation: str = "relu"
    dtype: object = None
    param_dtype: object = jnp.float32
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, residual=None, train=True):
        y = nn.Conv(
            self.features,
            (3, 3),
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv",
        )(x)
        y = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.99,
            epsilon=1e-5,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            axis_name=self.axis_name,
            name="bn",
        )(y)
        if residual is not None:
            y = y + residual
        return ACT[self.activation](y)


def _setup(seed, dtype, param_dtype, activation, impl, residual=True):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 6, 5, 3)) + 0.5, dtype or jnp.float32)
    res = jnp.asarray(rng.standard_normal((2, 6, 5, 8)), dtype or jnp.float32) if residual else None
    ours = ConvBN(8, activation=activation, dtype=dtype, param_dtype=param_dtype, impl=impl)
    v = ours.init(jax.random.key(seed), x, res, use_running_average=False)
    # Non-trivial BatchNorm parameters and running statistics.
    p = v["params"]
    p = {
        **p,
        "scale": (p["scale"] * jnp.asarray(rng.uniform(0.5, 2, 8), p["scale"].dtype)),
        "bias": p["bias"] + jnp.asarray(rng.standard_normal(8) * 0.3, p["bias"].dtype),
    }
    stats = {
        "mean": jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32),
        "var": jnp.asarray(rng.uniform(0.5, 2, 8), jnp.float32),
    }
    ours_v = {"params": p, "batch_stats": stats}
    ref = FlaxConvBN(8, activation=activation, dtype=dtype, param_dtype=param_dtype)
    ref_v = {
        "params": {"conv": p["conv"], "bn": {"scale": p["scale"], "bias": p["bias"]}},
        "batch_stats": {"bn": stats},
    }
    return x, res, ours, ours_v, ref, ref_v


def _to_ref_grads(g):
    return {"conv": g["conv"], "bn": {"scale": g["scale"], "bias": g["bias"]}}


@pytest.mark.parametrize(
    "dtype,param_dtype,activation,impl,tol",
    [
        (None, jnp.float32, "relu", "interpret", 1e-5),
        (None, jnp.float32, "silu", "xla", 1e-5),
        (jnp.bfloat16, jnp.float32, "relu", "interpret", 3e-2),
    ],
)
def test_train_mode_matches_flax(dtype, param_dtype, activation, impl, tol):
    x, res, ours, v, ref, rv = _setup(0, dtype, param_dtype, activation, impl)

    @jax.jit
    def run(v, rv):
        def loss(p, model, variables, **kw):
            out, upd = model.apply(
                {"params": p, "batch_stats": variables["batch_stats"]},
                x,
                res,
                mutable=["batch_stats"],
                **kw,
            )
            return jnp.sum(jnp.sin(out.astype(jnp.float32))), (out, upd)

        g, (out, upd) = jax.grad(loss, has_aux=True)(
            v["params"], ours, v, use_running_average=False
        )
        rg, (rout, rupd) = jax.grad(loss, has_aux=True)(rv["params"], ref, rv, train=True)
        return (out, upd, g), (rout, rupd, rg)

    (out, upd, g), (rout, rupd, rg) = run(v, rv)
    assert out.shape == (2, 6, 5, 8) and out.dtype == rout.dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(rout, np.float32), rtol=tol, atol=tol
    )
    # Running statistics: float32 sums either way, of conv outputs that may differ by a bf16
    # rounding between the two programs.
    stats_tol = 1e-6 if dtype is None else 1e-4
    for k in ("mean", "var"):
        np.testing.assert_allclose(
            upd["batch_stats"][k], rupd["batch_stats"]["bn"][k], atol=stats_tol
        )
        assert not np.allclose(upd["batch_stats"][k], v["batch_stats"][k])  # updated
    g, rg = _to_ref_grads(g), rg
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(rg), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b)))


def test_eval_mode_uses_running_statistics():
    x, res, ours, v, ref, rv = _setup(1, None, jnp.float32, "relu", "interpret")
    out = jax.jit(lambda v: ours.apply(v, x, res, use_running_average=True))(v)
    rout = ref.apply(rv, x, res, train=False)
    np.testing.assert_allclose(out, rout, atol=1e-5)
    # Different running statistics give a different output: they are what eval mode reads.
    v2 = {
        **v,
        "batch_stats": {"mean": v["batch_stats"]["mean"] + 1.0, "var": v["batch_stats"]["var"]},
    }
    assert not np.allclose(ours.apply(v2, x, res, use_running_average=True), out)


def test_nchw_input_is_transposed_once_and_output_is_nhwc():
    rng = np.random.default_rng(2)
    x_nchw = jnp.asarray(rng.standard_normal((2, 3, 6, 5)), jnp.float32)
    nhwc = ConvBN(8, impl="xla")
    nchw = ConvBN(8, impl="xla", input_layout="NCHW")
    v = nhwc.init(jax.random.key(0), nchw_to_nhwc(x_nchw), use_running_average=False)
    want = nhwc.apply(v, nchw_to_nhwc(x_nchw), use_running_average=True)
    got = nchw.apply(v, x_nchw, use_running_average=True)
    assert got.shape == (2, 6, 5, 8)
    np.testing.assert_array_equal(got, want)
    jaxpr = jax.make_jaxpr(lambda x: nchw.apply(v, x, use_running_average=True))(x_nchw)
    assert str(jaxpr).count("transpose[") == 1


def test_dtype_and_param_dtype_are_honoured():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 4, 3)), jnp.float32)
    layer = ConvBN(4, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, impl="interpret")
    v = jax.jit(lambda x: layer.init(jax.random.key(0), x, use_running_average=True))(x)
    assert {p.dtype for p in jax.tree.leaves(v["params"])} == {jnp.dtype(jnp.bfloat16)}
    assert {s.dtype for s in jax.tree.leaves(v["batch_stats"])} == {jnp.dtype(jnp.float32)}
    apply = jax.jit(lambda v, x: layer.apply(v, x, use_running_average=False, mutable=True))
    out, _ = apply(v, x)
    assert out.dtype == jnp.bfloat16
    assert (
        ConvBN(4, param_dtype=jnp.float32, impl="xla")
        .apply(
            ConvBN(4, impl="xla").init(jax.random.key(0), x, use_running_average=True),
            x,
            use_running_average=True,
        )
        .dtype
        == jnp.float32
    )


def test_axis_name_combines_batch_statistics():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 2, 5, 5, 3)), jnp.float32)  # 4 "devices"
    ours = ConvBN(6, axis_name="d", impl="xla")
    ref = FlaxConvBN(6, axis_name="d")
    v = ours.init(jax.random.key(0), x[0], use_running_average=False)
    rv = {
        "params": {
            "conv": v["params"]["conv"],
            "bn": {k: v["params"][k] for k in ("scale", "bias")},
        },
        "batch_stats": {"bn": v["batch_stats"]},
    }
    f = lambda x: ours.apply(v, x, use_running_average=False, mutable=["batch_stats"])
    rf = lambda x: ref.apply(rv, x, train=True, mutable=["batch_stats"])
    out, upd = jax.jit(jax.vmap(f, axis_name="d"))(x)
    rout, rupd = jax.jit(jax.vmap(rf, axis_name="d"))(x)
    np.testing.assert_allclose(out, rout, atol=1e-5)
    np.testing.assert_allclose(
        upd["batch_stats"]["mean"], rupd["batch_stats"]["bn"]["mean"], atol=1e-6
    )
    # Combined statistics are the same on every "device".
    np.testing.assert_allclose(
        upd["batch_stats"]["var"][0], upd["batch_stats"]["var"][3], atol=1e-7
    )


def test_bad_configuration_is_named():
    x = jnp.ones((1, 4, 4, 3))
    with pytest.raises(ValueError, match="activation must be one of"):
        ConvBN(4, activation="gelu").init(jax.random.key(0), x, use_running_average=True)
    with pytest.raises(ValueError, match="input_layout must be one of"):
        ConvBN(4, input_layout="CHWN").init(jax.random.key(0), x, use_running_average=True)
    with pytest.raises(ValueError, match="residual has shape"):
        ConvBN(4).init(jax.random.key(0), x, jnp.ones((1, 4, 4, 3)), use_running_average=True)
    with pytest.raises(ValueError, match="rank-4 NCHW"):
        nchw_to_nhwc(jnp.ones((3, 4)))


def _primitives(jaxpr):
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in jaxprs_in_params(eqn.params):
            yield from _primitives(sub)


@pytest.mark.parametrize("impl,kernels", [("auto", 0), ("pallas", 2)])
def test_auto_uses_the_xla_forms_the_cost_model_prefers(impl, kernels):
    """`impl="auto"` stages no Pallas call (the H100 cost model says XLA is faster)."""
    layer = ConvBN(8, dtype=jnp.bfloat16, impl=impl)
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 8), jnp.bfloat16)
    v = ConvBN(8, impl="xla").init(jax.random.key(1), x, use_running_average=False)
    jaxpr = jax.make_jaxpr(
        lambda v, x: layer.apply(v, x, x, use_running_average=False, mutable=["batch_stats"])
    )(v, x)
    assert list(_primitives(jaxpr.jaxpr)).count("pallas_call") == kernels
