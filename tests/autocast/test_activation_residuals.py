"""gelu / SwiGLU MLPs under autocast and apply_policy keep only the activation's inputs.

Left to autodiff, a tanh-gelu MLP keeps five hidden-sized tensors for the backward pass
(the GEMM output, `tanh(...)` and other intermediates, the gelu output) and a SwiGLU six
(float32 copies among them). Under a policy the activation keeps only its inputs; the next
GEMM keeps its own operand (the activation's output, or its fp8 copy).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax

HIDDEN = (8, 64)
POLICIES = {"float32": "f32", "bfloat16": "p=f32,c=bf16,o=f32", "float16": "p=f32,c=f16,o=f32"}
TOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}


def gelu_mlp(x, w1, b1, w2):
    return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2


def erf_gelu_mlp(x, w1, b1, w2):
    return jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2


def swiglu_mlp(x, w1, w3, w2):
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


# The hidden-sized residuals each MLP keeps: the activation's inputs and its output.
KEPT = {"gelu": 2, "erf-gelu": 2, "swiglu": 3}


def _args():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (8, 16))
    w1 = jax.random.normal(k[1], (16, 64)) / 4
    w2 = jax.random.normal(k[2], (64, 16)) / 8
    w3 = jax.random.normal(k[3], (16, 64)) / 4
    b1 = jnp.full((64,), 0.1)
    return {
        "gelu": (gelu_mlp, (x, w1, b1, w2)),
        "erf-gelu": (erf_gelu_mlp, (x, w1, b1, w2)),
        "swiglu": (swiglu_mlp, (x, w1, w3, w2)),
    }


def _hidden(fun, *args):
    """The dtypes of the hidden-sized residuals of `jax.vjp(fun, *args)`."""
    _, vjp = jax.vjp(fun, *args)
    return [str(r.dtype) for r in jax.tree.leaves(vjp) if np.shape(r) == HIDDEN]


@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("mlp", list(KEPT))
def test_autocast_mlp_keeps_only_the_activation_inputs_and_output(mlp, dtype):
    fun, args = _args()[mlp]
    kept = _hidden(mpjax.autocast(fun, POLICIES[dtype]), *args)
    assert kept == [dtype] * KEPT[mlp]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("mlp", list(KEPT))
def test_autocast_mlp_gradients_match_float64(mlp, dtype, jit):
    fun, args = _args()[mlp]
    grad = jax.grad(lambda *a: mpjax.autocast(fun, POLICIES[dtype])(*a).sum(), range(len(args)))
    grads = (jax.jit(grad) if jit else grad)(*args)
    with jax.enable_x64():
        args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        ref = jax.grad(lambda *a: fun(*a).sum(), range(len(args)))(*args64)
        ref = [np.asarray(r) for r in ref]
    for g, r in zip(grads, ref, strict=True):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < TOL[dtype], (mlp, dtype, err)


@pytest.mark.parametrize("dtype", list(POLICIES))
def test_autocast_mlp_forward_mode_still_works(dtype):
    """The chain is recomputed under `jax.checkpoint`, which `jvp` and `linearize` go through."""
    fun, (x, *ws) = _args()["gelu"]
    f = mpjax.autocast(lambda x: fun(x, *ws), POLICIES[dtype])
    y, t = jax.jvp(f, (x,), (jnp.ones_like(x),))
    _, lin = jax.linearize(f, x)
    np.testing.assert_allclose(lin(jnp.ones_like(x)), t, rtol=TOL[dtype], atol=TOL[dtype])
    with jax.enable_x64():
        x64, ws64 = np.asarray(x, np.float64), [np.asarray(w, np.float64) for w in ws]
        _, ref = jax.jvp(lambda x: fun(x, *ws64), (x64,), (np.ones_like(x64),))
    err = np.linalg.norm(np.asarray(t, np.float64) - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype]


class GeluMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.gelu(nn.Dense(64)(x)))


class SwiGLU(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.silu(nn.Dense(64)(x)) * nn.Dense(64)(x))


MODULES = {"gelu": GeluMLP, "swiglu": SwiGLU}
X = jax.random.normal(jax.random.key(1), (8, 16))


@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("mlp", list(MODULES))
def test_apply_policy_mlp_keeps_only_the_activation_inputs_and_output(mlp, dtype):
    model = mpjax.apply_policy(MODULES[mlp](), POLICIES[dtype])
    v = model.init(jax.random.key(0), X)
    assert _hidden(lambda v: model.apply(v, X), v) == [dtype] * KEPT[mlp]


@pytest.mark.parametrize("mlp", list(MODULES))
def test_apply_policy_with_fp8_saved_activations_keeps_the_inputs_and_the_fp8_operand(mlp):
    """The next GEMM keeps its operand in fp8; of the activation only its inputs stay bf16."""
    policy = mpjax.get_policy("p=f32,c=bf16,o=f32").with_saved_activations(jnp.float8_e4m3fn)
    model = mpjax.apply_policy(MODULES[mlp](), policy)
    v = model.init(jax.random.key(0), X)
    kept = _hidden(lambda v: model.apply(v, X), v)
    assert kept == ["bfloat16"] * (KEPT[mlp] - 1) + ["float8_e4m3fn"]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("mlp", list(MODULES))
def test_apply_policy_values_and_gradients_are_those_of_the_module_run_directly(mlp, dtype, jit):
    model = mpjax.apply_policy(MODULES[mlp](), POLICIES[dtype])
    v = model.init(jax.random.key(0), X)

    def loss(v, direct):
        if direct:  # the same PolicyModule, without the activation rewrite
            return nn.Module.apply(model, v, X).sum()
        return model.apply(v, X).sum()

    grad = jax.value_and_grad(loss)
    run = jax.jit(grad, static_argnums=1) if jit else grad
    (new, g_new), (old, g_old) = run(v, False), run(v, True)
    np.testing.assert_array_equal(new, old)
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])


class StatefulMLP(nn.Module):
    """BatchNorm statistics, dropout randomness and a sown value through the rewrite."""

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.gelu(nn.Dense(64)(x))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        self.sow("intermediates", "h", h)
        return nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(h))


def test_apply_policy_rewrite_keeps_state_rng_and_sown_values():
    model = mpjax.apply_policy(StatefulMLP(), "p=f32,c=bf16,o=f32")
    v = model.init(jax.random.key(0), X, False)
    rngs = {"dropout": jax.random.key(3)}

    def run(v, direct):
        call = nn.Module.apply if direct else type(model).apply
        kw = {"rngs": rngs, "mutable": ["batch_stats", "intermediates"]}
        out, state = call(model, v, X, True, **kw)
        return out.sum(), state

    (new, s_new), (old, s_old) = (
        jax.jit(jax.value_and_grad(run, has_aux=True), static_argnums=1)(v, d)[0] for d in (0, 1)
    )
    np.testing.assert_array_equal(new, old)
    for a, b in zip(jax.tree.leaves(s_new), jax.tree.leaves(s_old), strict=True):
        np.testing.assert_array_equal(a, b)


def test_apply_policy_eager_call_runs_as_written():
    """Concrete arrays: no trace, so Python control flow on values works as in Flax."""

    class Branchy(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(nn.Dense(64)(x))
            return nn.Dense(16)(h) if float(h.sum()) > -1e9 else h

    model = mpjax.apply_policy(Branchy(), "p=f32,c=bf16,o=f32")
    v = model.init(jax.random.key(0), X)
    assert model.apply(v, X).shape == (8, 16)


def _recomputed_inputs(jaxpr) -> list:
    """The shapes of the inputs of every checkpointed (recomputed) region in `jaxpr`."""
    return [
        [tuple(v.aval.shape) for v in e.invars]
        for e in jaxpr.eqns
        if e.primitive.name in ("checkpoint", "remat", "remat2")
    ]


@pytest.mark.parametrize("mlp", ["gelu", "erf-gelu"])
def test_autocast_recomputes_from_the_biased_value_not_from_the_bias(mlp):
    """`gelu(x @ w + b)` is recomputed from `x @ w + b`: reading `b` again in the backward
    pass would gather it again under FSDP."""
    fun, args = _args()[mlp]
    regions = _recomputed_inputs(jax.make_jaxpr(mpjax.autocast(fun, POLICIES["bfloat16"]))(*args))
    assert regions == [[HIDDEN]]


def test_apply_policy_recomputes_from_the_biased_value_not_from_the_bias():
    model = mpjax.apply_policy(GeluMLP(), POLICIES["bfloat16"])
    v = model.init(jax.random.key(0), X)
    regions = _recomputed_inputs(jax.make_jaxpr(lambda v: model.apply(v, X))(v))
    assert regions == [[HIDDEN]]


def test_apply_policy_rewrite_under_explicit_sharding_and_shard_map():
    """The rewritten apply on sharded inputs (`jax.set_mesh`, Explicit axes) and inside
    `jax.shard_map(check_vma=True)` gives the loss and gradients of the unsharded run."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    model = mpjax.apply_policy(GeluMLP(), POLICIES["bfloat16"])
    x = jax.random.normal(jax.random.key(1), (16, 16))
    v = model.init(jax.random.key(0), x)

    def loss(v, x):
        return model.apply(v, x).astype(jnp.float32).sum()

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(v, x)
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(explicit):
        got = jax.jit(jax.value_and_grad(loss))(
            jax.device_put(v, P()), jax.device_put(x, P("data"))
        )
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def local(v, x):  # the loss summed over devices; grads of replicated v come summed
        value, grads = jax.value_and_grad(loss)(v, x)
        return jax.lax.psum(value, "data"), grads

    mapped = jax.jit(
        jax.shard_map(
            local, mesh=auto, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=True
        )
    )(v, x)
    for value, grads in (got, mapped):
        np.testing.assert_allclose(value, ref_loss, rtol=1e-2)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2)


BAD_INPUTS = {
    "size-0": jnp.zeros((0, 16)),
    "-inf": jnp.full((8, 16), -jnp.inf),
    "nan": jnp.full((8, 16), jnp.nan),
    "tiny": jnp.full((8, 16), 1e-38),
    "huge": jnp.full((8, 16), 3e38),
}


@pytest.mark.parametrize("x", list(BAD_INPUTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mlp", list(MODULES))
def test_apply_policy_rewrite_on_bad_inputs_is_the_module_run_directly(mlp, dtype, x):
    """Empty, infinite, NaN, subnormal-sized and overflowing inputs: the same value and
    gradients (non-finite ones in the same places) as without the rewrite, under jit."""
    model = mpjax.apply_policy(MODULES[mlp](), POLICIES[dtype])
    inputs = BAD_INPUTS[x]
    v = model.init(jax.random.key(0), X)

    def loss(v, direct):
        out = nn.Module.apply(model, v, inputs) if direct else model.apply(v, inputs)
        return out.astype(jnp.float32).sum()

    run = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (new, g_new), (old, g_old) = run(v, False), run(v, True)
    np.testing.assert_array_equal(new, old)
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])
