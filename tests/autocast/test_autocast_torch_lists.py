"""`mpjax.autocast` against torch.autocast's op semantics, in JAX form.

Cases ported from torch's `test/test_autocast.py` and
`torch/testing/_internal/autocast_test_lists.py`: the float32 list (`pow`, `reciprocal`,
`rsqrt`, `mse_loss`, norms, `softmax`, `log_softmax`, `logsumexp`, `sum`, `prod`) runs in
float32 and returns float32 whatever the input dtype; float64 is never autocast; nested
regions keep their own policy; shard_map / pmap bodies are rewritten too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mpjax import autocast
from tests.helpers.policy import eqns, walk

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
F32 = np.dtype(np.float32)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


# ----------------------------------------------------------------------------- float32 list


def _rmsnorm(h):
    return h * lax.rsqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)


FP32_LIST = {
    "rmsnorm": _rmsnorm,
    "sum_of_squares": lambda h: jnp.sum(h**2, -1),
    "mse": lambda h: jnp.mean((h - 1.0) ** 2, -1),
    "x_times_x": lambda h: jnp.sum(h * h, -1),
    "abs_sq_norm": lambda h: jnp.sqrt(jnp.sum(jnp.abs(h) ** 2, -1)),
    "l2_norm": lambda h: jnp.linalg.norm(h, axis=-1),
    "reciprocal": lambda h: jnp.reciprocal(h),
    "pow_minus_one": lambda h: h**-1,
    "rsqrt": lambda h: lax.rsqrt(h),
}


def _values(dtype):
    """Positive values up to 300: their squares overflow float16 (max 65504)."""
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.uniform(100.0, 300.0, (4, 64)), dtype)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("arg_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("name", sorted(FP32_LIST))
def test_float32_list_does_not_overflow_float16(name, arg_dtype, jit):
    """A float16 argument, or a float32 one through a float16 GEMM: finite, float64-close."""
    fn = FP32_LIST[name]
    x = _values(arg_dtype)
    eye = jnp.eye(x.shape[-1], dtype=arg_dtype)
    through_gemm = (lambda x, w: fn(x @ w)) if arg_dtype == jnp.float32 else (lambda x, w: fn(x))
    out = maybe_jit(autocast(through_gemm, F16), jit)(x, eye)
    assert out.dtype == F32
    assert np.all(np.isfinite(np.asarray(out))), name
    ref = fn(np.asarray(np.asarray(x, np.float16), np.float64))  # the float16-rounded input
    assert rel_err(out, ref) < 2e-3, name


def test_gelu_power_stays_in_compute_dtype():
    """gelu's `x ** 3` runs in float32 but its tanh stays in the compute dtype."""
    f = autocast(lambda x, w: jax.nn.gelu(x @ w, approximate=True), BF16)
    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 8)), jnp.ones((8, 8)))
    assert [np.dtype(e.invars[0].aval.dtype) for e in eqns(jaxpr, "integer_pow")] == [F32]
    assert [e.invars[0].aval.dtype for e in eqns(jaxpr, "tanh")] == [jnp.bfloat16]


# ----------------------------------------------------------------------------- reductions


def _narrowing_converts(jaxpr):
    return [
        e
        for e in eqns(jaxpr, "convert_element_type")
        if np.dtype(e.params["new_dtype"]).itemsize < 4 and e.invars[0].aval.dtype == F32
    ]


REDUCTIONS = {
    "sum": (lambda h: jnp.sum(h, -1), 10.0),
    "mean": (lambda h: jnp.mean(h, -1), 10000.0),
    "logsumexp": (lambda h: jax.nn.logsumexp(h, -1), 0.5),
    "softmax": (lambda h: jax.nn.softmax(h, -1), 0.5),
    "log_softmax": (lambda h: jax.nn.log_softmax(h, -1), 0.5),
}


@pytest.mark.parametrize("compute", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions_of_low_precision_arguments_return_float32(name, compute):
    """torch's float32 ops return float32 for a float16 input: jnp's convert-back is dropped.

    8 x 70000 float16 values: their sum overflows float16, softmax's normaliser too
    (softmax 0, log_softmax -inf on the old code).
    """
    fn, scale = REDUCTIONS[name]
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.uniform(0.5, 1.0, (8, 70000)) * scale, compute)
    policy = f"params=float32,compute={jnp.dtype(compute).name},output=float32"
    f = autocast(fn, policy)
    assert not _narrowing_converts(jax.make_jaxpr(f)(h)), name
    out = f(h)
    ref = fn(np.asarray(h, np.float64))
    assert np.all(np.isfinite(np.asarray(out)))
    assert rel_err(out, ref) < 1e-4, name


def test_user_cast_of_a_reduction_is_kept():
    """`jnp.sum(x).astype(float16)` is the user's cast: it stays."""
    f = autocast(lambda h: jnp.sum(h.astype(jnp.float32), -1).astype(jnp.float16) * 2, F16)
    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 8), jnp.float16))
    assert len(_narrowing_converts(jaxpr)) == 1


# ----------------------------------------------------------------------------- losses


@pytest.mark.parametrize("jit", [False, True])
def test_nll_gathers_float32_log_probs(jit):
    """take_along_axis(log_softmax(logits), labels): gathered from float32 log-probs."""
    rng = np.random.default_rng(2)
    # Small integers: the bf16 GEMM is exact, so the logits are known exactly.
    x = jnp.asarray(rng.integers(-3, 4, (16, 32)), jnp.float32)
    w = jnp.asarray(rng.integers(-3, 4, (32, 100)), jnp.float32) / 8
    labels = jnp.asarray(rng.integers(0, 100, (16,)))

    def nll(x, w, labels):
        logp = jax.nn.log_softmax(x @ w, -1)
        return -jnp.take_along_axis(logp, labels[:, None], -1)[:, 0]

    f = autocast(nll, BF16)
    gathers = eqns(jax.make_jaxpr(f)(x, w, labels), "gather")
    assert [np.dtype(e.invars[0].aval.dtype) for e in gathers] == [F32]
    with jax.enable_x64(True):
        ref = nll(jnp.asarray(x, jnp.float64), jnp.asarray(w, jnp.float64), labels)
    out = maybe_jit(f, jit)(x, w, labels)
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) < 1e-4


# ----------------------------------------------------------------------------- float64


@pytest.mark.parametrize("compute", [jnp.float16, jnp.bfloat16])
def test_float64_is_not_autocast(compute):
    """torch autocasts float32 only: a float64 GEMM, its ops and output stay float64."""
    policy = f"params=float32,compute={jnp.dtype(compute).name},output=float32"
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float64)
        w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float64)
        fn = lambda x, w: jnp.tanh(x @ w) + jnp.sum(x)  # noqa: E731
        f = autocast(fn, policy)
        jaxpr = jax.make_jaxpr(f)(x, w)
        dots = eqns(jaxpr, "dot_general")
        assert [e.invars[0].aval.dtype for e in dots] == [jnp.float64]
        floats = [
            v.aval.dtype
            for e in jaxpr.jaxpr.eqns
            for v in [*e.invars, *e.outvars]
            if jnp.issubdtype(v.aval.dtype, jnp.floating)
        ]
        assert set(floats) == {np.dtype(np.float64)}  # no convert to or from a narrow type
        out = f(x, w)
        assert out.dtype == jnp.float64
        # Bits under the same jit: eager and jitted float64 differ by an ulp in JAX itself
        # (jax 0.12's XLA:CPU fuses `tanh(x @ w) + sum(x)` differently when jitted).
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w)), np.asarray(jax.jit(fn)(x, w)))
        np.testing.assert_allclose(np.asarray(out), np.asarray(fn(x, w)), rtol=1e-14)


# ----------------------------------------------------------------------------- nesting


def _gemm_dtypes(jaxpr):
    return sorted(str(e.invars[0].aval.dtype) for e in eqns(jaxpr, "dot_general"))


NESTED = [("bfloat16", "float32"), ("float16", "bfloat16"), ("bfloat16", "float16")]


@pytest.mark.parametrize(("outer", "inner"), NESTED)
def test_nested_region_keeps_its_policy_forward_and_backward(outer, inner):
    """An inner region's GEMMs run in its compute dtype (forward, dW and dx), the outer's in
    the outer's: inner "float32" is torch's `autocast(enabled=False)`."""
    inner_f = autocast(lambda h, w2: jnp.tanh(h @ w2), f"p=f32,c={inner},o=f32")

    def model(x, w1, w2):
        return jnp.sum(inner_f(jnp.tanh(x @ w1), w2) ** 2)

    outer_f = autocast(model, f"p=f32,c={outer},o=f32")
    x, w1, w2 = jnp.ones((4, 8)), jnp.full((8, 16), 0.1), jnp.full((16, 2), 0.1)
    fwd = jax.make_jaxpr(outer_f)(x, w1, w2)
    assert _gemm_dtypes(fwd) == sorted([outer, inner])
    bwd = jax.make_jaxpr(jax.grad(outer_f, argnums=(1, 2)))(x, w1, w2)
    # outer GEMM: forward and dW1; inner GEMM: forward, dW2 and dh.
    assert _gemm_dtypes(bwd) == sorted([outer] * 2 + [inner] * 3)
    grads = jax.grad(outer_f, argnums=(1, 2))(x, w1, w2)
    ref = jax.grad(model, argnums=(1, 2))(x, w1, w2)
    for g, r in zip(grads, ref, strict=True):
        assert rel_err(g, r) < 2e-2


# ----------------------------------------------------------------------------- shard_map / pmap


def _sharded_inputs():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32) / 8
    return x, w


def test_shard_map_body_is_autocast():
    """A shard_map body's GEMM runs in the compute dtype; the psum'd result matches f32."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))

    def fn(x, w):
        body = lambda a, b: jax.lax.psum(jnp.tanh(a) @ b, "d")  # noqa: E731
        out = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "d"), P("d", None)), out_specs=P())(
            x, w
        )
        return jnp.sum(out**2)

    x, w = _sharded_inputs()
    f = autocast(fn, BF16)
    assert _gemm_dtypes(jax.make_jaxpr(f)(x, w)) == ["bfloat16"]
    assert rel_err(jax.jit(f)(x, w), fn(x, w)) < 2e-2
    g, ref = jax.grad(f, argnums=1)(x, w), jax.grad(fn, argnums=1)(x, w)
    assert rel_err(g, ref) < 3e-2


def test_pmap_body_is_autocast():
    """A pmap body's GEMM runs in the compute dtype; the result matches float32."""

    def fn(x, w):
        return jax.pmap(lambda a: jax.lax.psum(jnp.tanh(a) @ w, "i"), axis_name="i")(x)

    x, w = _sharded_inputs()
    x = x.reshape(8, 1, 64)
    f = autocast(fn, BF16)
    assert _gemm_dtypes(jax.make_jaxpr(f)(x, w)) == ["bfloat16"]
    assert rel_err(f(x, w), fn(x, w)) < 2e-2


def test_unknown_higher_order_primitive_is_bound_as_traced():
    """A higher-order primitive autocast has no rule for runs with its traced dtypes."""

    def fn(a, b):
        matvec = lambda v: a @ v  # noqa: E731
        solve = lambda mv, r: r / jnp.diag(a)  # noqa: E731
        return lax.custom_linear_solve(matvec, b, solve, symmetric=True)

    a = jnp.diag(jnp.arange(1.0, 9.0))
    b = jnp.arange(8.0)
    out = autocast(fn, BF16)(a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(a, b)), rtol=1e-6)
    assert any(e.primitive.name == "custom_linear_solve" for e in walk(jax.make_jaxpr(fn)(a, b)))
