"""Tests for `mpjax._src.autocast.fp8_recompute`: fp8 GEMM inputs quantised from a float32
recomputation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import mpjax
from mpjax import Fp8Recipe
from mpjax._src.autocast.fp8_recompute import (
    exclusive_chains,
    pointwise_chain,
    recomputed,
    reevaluate_f32,
)
from mpjax.fp8 import fp8_dot_general

DENSE = (((1,), (0,)), ((), ()))
POLICY = "params=float32,compute=bfloat16,output=float32"
# relative L2 error vs float64 of an e4m3 x e4m3 / e5m2 x e4m3 GEMM (tests/test_fp8_autocast)
TOL_E4M3, TOL_E5M2 = 0.05, 0.09


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def wide(rng, shape, spread=3.0):
    scale = np.exp(rng.uniform(-spread, spread, shape[:1] + (1,) * (len(shape) - 1)))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def chain_of(fn, *args):
    """(jaxpr, chain of its first output) for `fn` traced on `args`."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    return jaxpr, pointwise_chain(jaxpr.outvars[0], producers)


def full_f32_ops(fn, args, name, shape):
    """Equations `name` with a float32 output of `shape`, in `fn`'s jaxpr and sub-jaxprs."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                if eqn.primitive.name == name and v.aval.shape == shape:
                    found.append(np.dtype(v.aval.dtype))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.gelu(nn.Dense(128)(x)))


def test_gelu_input_of_fp8_gemm_is_quantised_from_float32_recomputation():
    rng = np.random.default_rng(0)
    model, x = MLP(), wide(rng, (64, 96), 2.0)
    params = model.init(jax.random.key(0), x)
    fwd = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe())
    tanhs = full_f32_ops(fwd, (params, x), "tanh", (64, 128))
    # the gelu itself in bfloat16 (autocast's compute dtype) and its float32 recomputation
    assert sorted(t.name for t in tanhs) == ["bfloat16", "float32"]
    plain = mpjax.autocast(model.apply, POLICY)  # no fp8: nothing recomputed
    assert [t.name for t in full_f32_ops(plain, (params, x), "tanh", (64, 128))] == ["bfloat16"]


def test_pointwise_chain_needs_a_full_size_transcendental_and_stays_short():
    x = jnp.ones((32, 16), jnp.bfloat16)
    b = jnp.ones((16,), jnp.bfloat16)
    _, gelu = chain_of(lambda x, b: jax.nn.gelu(x * 2 + b), x, b)
    assert gelu is not None and {e.primitive.name for e in gelu} >= {"mul", "add"}
    assert chain_of(lambda x, b: jax.nn.relu(x + b), x, b)[1] is None  # nothing costly
    # a transcendental on a broadcast statistic only (LayerNorm's rsqrt) is not worth it
    small = lambda x: x * jax.lax.rsqrt(jnp.mean(x, axis=1, keepdims=True))  # noqa: E731
    assert chain_of(small, x)[1] is None

    def long(x):
        x = jnp.tanh(x)
        for i in range(70):
            x = x + i
        return x

    assert chain_of(long, x)[1] is None  # a residual stream: too long to re-evaluate


def test_reevaluate_f32_matches_a_float32_evaluation():
    rng = np.random.default_rng(1)
    x = jnp.asarray(wide(rng, (32, 64), 2.0), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(64), jnp.bfloat16)
    # constants exact in bfloat16 (the traced literals are bfloat16, as in the program)
    fn = lambda x, b: (jnp.tanh(x * 0.5 + b) * 0.25 + x).astype(jnp.bfloat16)  # noqa: E731
    jaxpr, chain = chain_of(fn, x, b)
    values = dict(zip(jaxpr.invars, (x, b), strict=True))
    out = reevaluate_f32(chain, jaxpr.outvars[0], values.__getitem__)
    assert out.dtype == jnp.float32
    x64, b64 = np.asarray(x, np.float64), np.asarray(b, np.float64)
    ref = np.tanh(x64 * 0.5 + b64) * 0.25 + x64
    assert rel_err(out, ref) < 1e-6  # float32 throughout; a bfloat16 step would give ~1e-3
    assert rel_err(fn(x, b), ref) > 1e-4


def test_lhs_quant_takes_the_scale_of_lhs_and_no_gradient():
    rng = np.random.default_rng(2)
    a = jnp.asarray(wide(rng, (64, 128)), jnp.bfloat16)
    w = rng.standard_normal((128, 96)).astype(np.float32)
    rec = Fp8Recipe()
    a64 = np.asarray(a, np.float64)
    base = fp8_dot_general(a, w, DENSE, rec, jnp.bfloat16)
    same = fp8_dot_general(a, w, DENSE, rec, jnp.bfloat16, lhs_quant=a.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(base), np.asarray(same))  # exact copy: bitwise
    # quantising half of lhs with lhs's scale halves the product (the scale of `lhs_quant`
    # would give the full product back)
    half = fp8_dot_general(a, w, DENSE, rec, jnp.bfloat16, lhs_quant=0.5 * a.astype(jnp.float32))
    assert rel_err(half, 0.5 * (a64 @ w)) < TOL_E4M3

    def loss(x, q, y):
        out = fp8_dot_general(x, y, DENSE, rec, jnp.bfloat16, lhs_quant=q)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    ga, gq, gw = jax.grad(loss, (0, 1, 2))(a, a.astype(jnp.float32), w)
    ra, rw = jax.grad(lambda x, y: loss(x, None, y), (0, 1))(a, w)
    assert not np.any(np.asarray(gq))
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(ra))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(rw))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_non_finite_gemm_input_still_gives_non_finite_output(where):
    """An inf before the gelu reaches the output through the recomputed quantisation."""
    rng = np.random.default_rng(3)
    model, x = MLP(), wide(rng, (64, 96), 2.0)
    params = model.init(jax.random.key(0), x)
    idx = {"first": 0, "middle": x.size // 2, "last": x.size - 1}[where]
    x = x.reshape(-1).copy()
    x[idx] = np.inf
    fwd = jax.jit(mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe()))
    out = np.asarray(fwd(params, x.reshape(64, 96)))
    assert not np.all(np.isfinite(out))


def _gelu_chain(x, b):
    return jax.nn.gelu(x * 0.5 + b)


def test_recomputed_keeps_only_inputs_and_gives_the_same_gradient(capsys):
    rng = np.random.default_rng(4)
    x = jnp.asarray(wide(rng, (32, 64), 2.0), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(64), jnp.bfloat16)
    g = jnp.asarray(wide(rng, (32, 64), 2.0), jnp.bfloat16)
    print_saved_residuals(_gelu_chain, x, b)
    plain = capsys.readouterr().out.strip().splitlines()
    print_saved_residuals(recomputed(_gelu_chain), x, b)
    kept = capsys.readouterr().out.strip().splitlines()
    assert len(plain) > 2  # the plain chain keeps intermediates (tanh, ...)
    assert kept == ["bf16[32,64] from the argument x", "bf16[64] from the argument b"]
    out, vjp = jax.vjp(_gelu_chain, x, b)
    out_r, vjp_r = jax.vjp(recomputed(_gelu_chain), x, b)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_r))
    for a, r in zip(vjp(g), vjp_r(g), strict=True):  # same ops in the same dtypes
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))
    x64, b64, g64 = (np.asarray(v, np.float64) for v in (x, b, g))
    z = x64 * 0.5 + b64
    t = np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3))
    dz = g64 * (
        0.5 * (1 + t) + 0.5 * z * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)
    )
    assert rel_err(vjp_r(g)[0], 0.5 * dz) < 0.02  # bfloat16 arithmetic
    assert rel_err(vjp_r(g)[1], dz.sum(0)) < 0.02


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_recomputed_keeps_a_non_finite_cotangent_non_finite(where):
    rng = np.random.default_rng(5)
    x = jnp.asarray(wide(rng, (16, 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(32), jnp.float32)
    g = np.asarray(wide(rng, (16, 32)), np.float32).reshape(-1)
    g[{"first": 0, "middle": g.size // 2, "last": g.size - 1}[where]] = np.inf
    _, vjp = jax.vjp(recomputed(_gelu_chain), x, b)
    dx, db = vjp(jnp.asarray(g.reshape(16, 32)))
    assert not np.all(np.isfinite(np.asarray(dx))) and not np.all(np.isfinite(np.asarray(db)))


def test_exclusive_chains_only_take_chains_nothing_else_reads():
    x, w = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    b = jnp.ones((64,), jnp.bfloat16)
    always = lambda eqn: True  # noqa: E731

    def only_gemm(x, b, w):
        return _gelu_chain(x, b) @ w

    def also_output(x, b, w):
        h = _gelu_chain(x, b)
        return h @ w, h

    jaxpr = jax.make_jaxpr(only_gemm)(x, b, w).jaxpr
    (chain,) = exclusive_chains(jaxpr, always).values()
    assert {e.primitive.name for e in chain} >= {"mul", "add"}
    assert exclusive_chains(jaxpr, lambda eqn: False) == {}  # not an fp8 GEMM
    assert exclusive_chains(jax.make_jaxpr(also_output)(x, b, w).jaxpr, always) == {}


def test_autocast_fp8_keeps_no_gelu_intermediate_for_the_backward(capsys):
    rng = np.random.default_rng(6)
    model, x = MLP(), wide(rng, (64, 96), 2.0)
    params = model.init(jax.random.key(0), x)
    residuals = {}
    for name, fp8 in (("bf16", None), ("fp8", Fp8Recipe())):
        fwd = mpjax.autocast(model.apply, POLICY, fp8=fp8)
        print_saved_residuals(lambda p, fwd=fwd: fwd(p, x).sum(), params)
        residuals[name] = capsys.readouterr().out.strip().splitlines()
    full = lambda lines: [r for r in lines if r.startswith("bf16[64,128]")]  # noqa: E731
    assert not any("tanh" in r for r in residuals["bf16"] + residuals["fp8"])
    # bf16 keeps the Dense_0 output (the GELU's input) and the GELU's output, which Dense_1's
    # weight gradient reads (the chain is recomputed: activation_residuals.py); fp8 keeps
    # only the Dense_0 output (Dense_1 keeps its own fp8 operand).
    assert len(full(residuals["bf16"])) == 2 and len(full(residuals["fp8"])) == 1
    # No float32 activation-sized residual: the float32 power is not saved for the backward.
    assert not any(r.startswith("f32[64,128]") for r in residuals["bf16"] + residuals["fp8"])


def test_recomputed_chain_gives_the_gradient_of_the_kept_one(monkeypatch):
    """A chain with a boolean input (`where`) and a captured constant, under jit and vmap."""
    rng = np.random.default_rng(7)
    x = wide(rng, (2, 64, 96), 2.0)
    w1 = (rng.standard_normal((96, 128)) / 10).astype(np.float32)
    w2 = (rng.standard_normal((128, 64)) / 10).astype(np.float32)
    c = rng.standard_normal(128).astype(np.float32)

    def f(w1, w2, x):
        h = x @ w1
        h = jnp.where(h > 0, jnp.tanh(h + c), 0.1 * jnp.exp(h))
        return jnp.sum((h @ w2).astype(jnp.float32) ** 2)

    def grads():
        fn = mpjax.autocast(f, POLICY, fp8=Fp8Recipe(min_dim=32))
        return jax.jit(jax.vmap(jax.grad(fn, (0, 1)), (None, None, 0)))(w1, w2, x)

    recomputed_grads = grads()
    monkeypatch.setattr("mpjax._src.autocast.fp8_hook.exclusive_chains", lambda *a: {})
    kept_grads = grads()
    # The same ops; XLA rounds bfloat16 intermediates at different places in the two
    # programs, and e5m2 gradient quantisation turns that into e5m2-sized differences.
    for a, b in zip(recomputed_grads, kept_grads, strict=True):
        assert a.shape == b.shape and np.all(np.isfinite(np.asarray(a)))
        assert rel_err(a, b) < TOL_E5M2, rel_err(a, b)


def test_a_chain_intermediate_read_by_the_gemm_is_not_deferred():
    # The GEMM reads the chain's output (h) and one of its intermediates (t): only the output
    # is re-evaluated at the GEMM, so the chain must stay where it is (it raised KeyError).
    rng = np.random.default_rng(7)
    x, w = jnp.asarray(wide(rng, (32, 64))), jnp.asarray(wide(rng, (64, 128), 1.0))

    def f(x, w):
        a = x @ w
        t = jnp.tanh(a)
        h = a * t
        return jnp.sum(jax.lax.dot_general(h, t, (((1,), (1,)), ((), ()))) ** 2)

    jaxpr = jax.make_jaxpr(f)(x, w).jaxpr
    assert exclusive_chains(jaxpr, lambda eqn: True) == {}
    got = mpjax.autocast(f, POLICY, fp8=Fp8Recipe())(x, w)
    ref = f(np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert abs(float(got) - float(ref)) / abs(float(ref)) < 4 * TOL_E4M3


def test_float16_compute_does_not_overflow_the_unscaled_product():
    # fp8 products reach 448 * 448 * K before the rescale: beyond float16's 65504.
    rng = np.random.default_rng(8)
    x = jnp.asarray(wide(rng, (64, 256), 1.0))
    w1, w2 = (jnp.asarray(wide(rng, s, 1.0) / 64) for s in ((256, 256), (256, 128)))

    def f(x, w1, w2):
        return jnp.sum(jnp.tanh((x @ w1) @ w2) ** 2)

    policy = "params=float32,compute=float16,output=float32"
    value, grads = jax.value_and_grad(mpjax.autocast(f, policy, fp8=Fp8Recipe()), argnums=(1, 2))(
        x, w1, w2
    )
    ref_value, ref_grads = jax.value_and_grad(f, argnums=(1, 2))(
        *(np.asarray(a, np.float64) for a in (x, w1, w2))
    )
    assert np.isfinite(float(value))
    assert abs(float(value) - float(ref_value)) / abs(float(ref_value)) < TOL_E4M3
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 3 * TOL_E5M2
