"""Tests for `mpjax.autocast`: jaxpr dtypes, numerics vs float64, transformations, op lists."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Literal, jaxprs_in_params

import mpjax
from mpjax import OpLists, autocast
from mpjax._src.autocast.rules import scan_counts
from tests.helpers.numerics import f64_reference, tree_rel_err

LOW_DTYPES = [jnp.bfloat16, jnp.float16]
F32 = np.dtype(np.float32)


# ----------------------------------------------------------------------------- helpers


def iter_eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' params."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from iter_eqns(sub)


def eqns_named(jaxpr, *names):
    return [e for e in iter_eqns(jaxpr) if e.primitive.name in names]


def is_float(dtype):
    return jnp.issubdtype(dtype, jnp.floating)


def in_dtypes(eqn):
    return [np.dtype(v.aval.dtype) for v in eqn.invars if not isinstance(v, Literal)]


def out_dtypes(eqn):
    return [np.dtype(v.aval.dtype) for v in eqn.outvars]


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def policy_for(compute):
    return f"params=float32,compute={jnp.dtype(compute).name},output=float32"


# ----------------------------------------------------------------------------- models


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(10)(x)


class Block(nn.Module):
    """A pre-LN transformer block: attention, LayerNorm, MLP."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(32)(h)
        h = nn.gelu(h)
        return x + nn.Dense(x.shape[-1])(h)


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(key, shape, jnp.float32)


@functools.lru_cache
def cnn_setup(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    model = CNN()
    x = _normal(k1, (4, 6, 6, 3))
    variables = jax.jit(model.init)(k2, x)
    labels = jax.random.randint(k3, (4,), 0, 10)

    def forward(params, batch_stats, x):
        return model.apply(
            {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )

    def loss(params, batch_stats, x):
        logits, _ = forward(params, batch_stats, x)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    return forward, loss, (variables["params"], variables["batch_stats"], x)


@functools.lru_cache
def block_setup(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    model = Block()
    x = _normal(k1, (2, 8, 16))
    params = jax.jit(model.init)(k2, x)["params"]

    def forward(params, x):
        return model.apply({"params": params}, x)

    def loss(params, x):
        return jnp.mean(jnp.sin(forward(params, x)))

    return forward, loss, (params, x)


SETUPS = {"cnn": cnn_setup, "block": block_setup}


# ----------------------------------------------------------------------------- jaxpr dtypes


@pytest.mark.parametrize("compute", LOW_DTYPES)
def test_cnn_jaxpr_dtypes(compute):
    forward, _, args = cnn_setup()
    jaxpr = jax.make_jaxpr(autocast(forward, policy_for(compute)))(*args)
    compute = np.dtype(compute)

    mm = eqns_named(jaxpr, "conv_general_dilated", "dot_general")
    assert {e.primitive.name for e in mm} == {"conv_general_dilated", "dot_general"}
    for e in mm:
        assert in_dtypes(e) == [compute, compute], e
    # GEMMs and convolutions return the compute dtype (the backends accumulate them in
    # float32 either way; a float32 request makes XLA:GPU widen a convolution to float32
    # and write a GEMM's result in float32 for a separate convert).
    for e in mm:
        assert e.params["preferred_element_type"] is None and out_dtypes(e) == [compute], e
    # BatchNorm statistics (mean, mean of squares) and rsqrt run in float32.
    stats = eqns_named(jaxpr, "reduce_sum", "square", "rsqrt")
    assert len(stats) >= 5
    for e in stats:
        assert in_dtypes(e) == [F32] and out_dtypes(e) == [F32], e
    # Outputs (logits and updated batch stats) leave in the output dtype.
    assert all(np.dtype(a.dtype) == F32 for a in jaxpr.out_avals)


@pytest.mark.parametrize("compute", LOW_DTYPES)
def test_transformer_jaxpr_dtypes(compute):
    forward, _, args = block_setup()
    jaxpr = jax.make_jaxpr(autocast(forward, policy_for(compute)))(*args)
    compute = np.dtype(compute)

    dots = eqns_named(jaxpr, "dot_general")
    assert len(dots) == 8  # q, k, v, logits, weighted values, out projection, 2 MLP
    for e in dots:
        assert in_dtypes(e) == [compute, compute], e
        assert e.params["preferred_element_type"] is None and out_dtypes(e) == [compute], e
    # LayerNorm statistics and the softmax (max, exp, sum, normalising div) in float32.
    for e in eqns_named(jaxpr, "reduce_sum", "reduce_max", "exp", "rsqrt", "square"):
        assert set(in_dtypes(e)) == {F32} and out_dtypes(e) == [F32], e
    divs = [e for e in eqns_named(jaxpr, "div") if e.invars[1].aval.shape[-1:] == (1,)]
    assert divs and all(out_dtypes(e) == [F32] for e in divs)
    # The MLP after its bias add (gelu's tanh) stays in the compute dtype.
    assert [in_dtypes(e) for e in eqns_named(jaxpr, "tanh")] == [[compute]]


def test_float32_policy_leaves_dtypes_alone():
    forward, _, args = block_setup()
    jaxpr = jax.make_jaxpr(autocast(forward, "float32"))(*args)
    for e in iter_eqns(jaxpr):
        assert all(d == F32 for d in in_dtypes(e) + out_dtypes(e) if is_float(d)), e


# ----------------------------------------------------------------------------- numerics


@functools.lru_cache
def forward_case(name):
    """(forward, args, float64 reference, float32 output) for a model, computed once."""
    forward, _, args = SETUPS[name](seed=1)
    return forward, args, f64_reference(forward, *args), jax.jit(forward)(*args)


@functools.lru_cache
def grad_case(name):
    """(loss, args, float64 reference gradient) for a model, computed once."""
    _, loss, args = SETUPS[name](seed=2)
    return loss, args, f64_reference(jax.grad(loss), *args)


def check_forward(name, compute, jit):
    forward, args, ref, out32 = forward_case(name)
    ac = autocast(forward, policy_for(compute))
    out_ac = jax.jit(ac)(*args) if jit else ac(*args)
    chex.assert_trees_all_equal_dtypes(out_ac, out32)
    assert tree_rel_err(out32, ref) < 1e-5
    err = tree_rel_err(out_ac, ref)
    assert err < 2e-2
    assert err > 20 * tree_rel_err(out32, ref)  # it really computed in low precision


@pytest.mark.parametrize("name", ["cnn", "block"])
@pytest.mark.parametrize("compute", LOW_DTYPES)
def test_forward_matches_float64_within_low_precision_tolerance(name, compute):
    check_forward(name, compute, jit=True)


@pytest.mark.parametrize("name", ["cnn", "block"])
def test_forward_without_jit(name):
    check_forward(name, jnp.bfloat16, jit=False)


@pytest.mark.parametrize("name", ["cnn", "block"])
@pytest.mark.parametrize("compute", LOW_DTYPES)
def test_grad_matches_float64_and_is_float32(name, compute):
    loss, args, ref = grad_case(name)
    g = jax.jit(jax.grad(autocast(loss, policy_for(compute))))(*args)
    chex.assert_trees_all_equal_dtypes(g, args[0])  # float32 params get float32 grads
    assert tree_rel_err(jax.jit(jax.grad(loss))(*args), ref) < 1e-4
    assert tree_rel_err(g, ref) < 2e-2


def test_backward_matmuls_run_in_compute_dtype():
    _, loss, args = block_setup()
    jaxpr = jax.make_jaxpr(jax.grad(autocast(loss)))(*args)
    dots = eqns_named(jaxpr, "dot_general")
    assert len(dots) == 8 * 3  # forward, and two cotangent matmuls each
    bf16 = np.dtype(jnp.bfloat16)
    for e in dots:
        assert in_dtypes(e) == [bf16, bf16], e


def test_low_precision_params_keep_their_dtype_and_grads():
    _, loss, (params, x) = block_setup()
    params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    g = jax.eval_shape(jax.grad(autocast(loss)), params16, x)
    chex.assert_trees_all_equal_dtypes(g, params16)


def test_nonfinite_inputs_propagate_like_float32():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    w1, w2 = _normal(k1, (8, 16), 0.3), _normal(k2, (16, 4), 0.3)

    def f(x):
        return jax.nn.softmax(jax.nn.gelu(x @ w1) @ w2)

    x = _normal(k3, (6, 8))
    x = x.at[0, 0].set(jnp.nan).at[3, 4].set(jnp.inf).at[-1, -1].set(-jnp.nan)
    ac = jax.jit(autocast(f))
    out, out32 = np.asarray(ac(x)), np.asarray(f(x))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out32))
    assert np.isnan(out[[0, 3, 5]]).all() and np.isfinite(out[[1, 2, 4]]).all()
    assert rel_err(out[[1, 2, 4]], out32[[1, 2, 4]]) < 2e-2


def test_output_dtype_follows_policy():
    forward, _, args = block_setup()
    assert autocast(forward, "p=f32,c=bf16,o=bf16")(*args).dtype == jnp.bfloat16
    assert autocast(forward, "p=f32,c=bf16,o=f32")(*args).dtype == jnp.float32


# ----------------------------------------------------------------------------- transformations


def test_vmap_of_grad_of_autocast_matches_float64():
    _, loss, (params, x) = block_setup(seed=4)
    grad = jax.grad(autocast(loss))
    per_example = jax.jit(jax.vmap(grad, in_axes=(None, 0)))(params, x[:, None])
    chex.assert_trees_all_equal_dtypes(jax.tree.map(lambda g: g[0], per_example), params)
    ref = f64_reference(jax.vmap(jax.grad(loss), in_axes=(None, 0)), params, x[:, None])
    assert tree_rel_err(per_example, ref) < 2e-2


class ScanStack(nn.Module):
    """Three residual MLP layers as one `nn.scan` over stacked parameters."""

    @nn.compact
    def __call__(self, x):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, carry, _):
                h = nn.Dense(carry.shape[-1])(nn.LayerNorm()(carry))
                return carry + jnp.tanh(h), jnp.sum(h)

        stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return stack()(x, None)


@functools.lru_cache
def scan_case():
    model = ScanStack()
    x = _normal(jax.random.key(5), (4, 8))
    params = jax.jit(model.init)(jax.random.key(6), x)["params"]

    def loss(params, x):
        out, sums = model.apply({"params": params}, x)
        return jnp.mean(out**2) + jnp.mean(sums)

    return loss, params, x, f64_reference(jax.value_and_grad(loss), params, x)


def test_scan_counts_split_operands_on_this_jax_version():
    """`scan_counts` reads the const/carry split from `num_consts`/`num_carry` (jax 0.10) or
    `ft_in` (jax >= 0.11); a scan with a closed-over constant, a two-part carry and a scanned
    input autocasts (`KeyError: 'num_consts'` on jax 0.11 before) with the carry in float32."""
    w = jnp.full((4, 4), 0.5, jnp.float32)

    def f(c, xs):
        def body(carry, x):
            h, n = carry
            return (jnp.tanh(h @ w + x), n + 1.0), jnp.sum(h)

        return lax.scan(body, c, xs)

    c, xs = (jnp.ones((2, 4)), jnp.float32(0)), jnp.ones((3, 2, 4))
    (scan,) = eqns_named(jax.make_jaxpr(f)(c, xs), "scan")
    nc, ncarry = scan_counts(scan.params)
    body = scan.params["jaxpr"]
    assert len(scan.invars) == nc + ncarry + 1  # [*consts, *carry, xs]
    assert body.in_avals[nc : nc + ncarry] == body.out_avals[:ncarry]
    assert body.in_avals[-1].shape == (2, 4)  # one slice of xs
    (ac_scan,) = eqns_named(jax.make_jaxpr(autocast(f))(c, xs), "scan")
    (dot,) = eqns_named(ac_scan.params["jaxpr"], "dot_general")
    assert in_dtypes(dot) == [np.dtype(jnp.bfloat16)] * 2
    got, want = jax.jit(autocast(f))(c, xs), f(c, xs)
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("remat", [False, True])
def test_nn_scan_layers_and_checkpoint(remat):
    loss, params, x, (ref, ref_grad) = scan_case()
    ac = autocast(jax.checkpoint(loss) if remat else loss)
    jaxpr = jax.make_jaxpr(ac)(params, x)
    (scan,) = eqns_named(jaxpr, "scan")
    # The carry keeps its traced float32 type; the matmul in the body runs in bfloat16.
    nc, _ = scan_counts(scan.params)
    assert np.dtype(scan.params["jaxpr"].in_avals[nc].dtype) == F32
    bf16 = np.dtype(jnp.bfloat16)
    (dot,) = eqns_named(scan.params["jaxpr"], "dot_general")
    assert in_dtypes(dot) == [bf16, bf16]
    assert bool(eqns_named(jaxpr, "remat2")) == remat
    # Forward, backward and (with remat) the recomputed forward all matmul in bfloat16.
    grad_jaxpr = jax.make_jaxpr(jax.grad(ac))(params, x)
    dots = eqns_named(grad_jaxpr, "dot_general")
    assert len(dots) >= 3 and all(in_dtypes(e) == [bf16, bf16] for e in dots)
    if remat:
        assert eqns_named(grad_jaxpr, "remat2")

    value, g = jax.jit(jax.value_and_grad(ac))(params, x)
    assert rel_err(value, ref) < 2e-2
    chex.assert_trees_all_equal_dtypes(g, params)
    assert tree_rel_err(g, ref_grad) < 2e-2


def test_control_flow_while_cond_scan_and_jit():
    k1, k2 = jax.random.split(jax.random.key(7))
    w = _normal(k1, (8, 8), 0.3)

    @jax.jit
    def inner(h):
        return jnp.tanh(h @ w)

    def f(x):
        h = lax.fori_loop(0, 3, lambda i, h: inner(h) + 0.1 * h, x)  # scan (static trip count)
        n = jnp.int32(jnp.sum(x > 0) % 3)  # dynamic trip count: a while loop
        h = lax.fori_loop(0, n, lambda i, h: h * 0.9, h)
        h = lax.cond(jnp.sum(h) > 0, lambda h: h @ w, lambda h: jnp.exp(-h), h)
        return jnp.sum(h**2)

    x = _normal(k2, (4, 8))
    jaxpr = jax.make_jaxpr(autocast(f))(x)
    for name in ("while", "cond", "scan", "jit"):
        assert eqns_named(jaxpr, name), name
    bf16 = np.dtype(jnp.bfloat16)
    dots = eqns_named(jaxpr, "dot_general")
    assert len(dots) == 2 and all(in_dtypes(e) == [bf16, bf16] for e in dots)
    (cond,) = eqns_named(jaxpr, "cond")
    assert out_dtypes(cond) == [F32]  # widest of the bf16 matmul branch and the f32 exp branch
    ref = f64_reference(f, x)
    assert rel_err(autocast(f)(x), ref) < 2e-2
    assert rel_err(jax.jit(autocast(f))(x), ref) < 2e-2


def test_custom_jvp_rule_is_kept_and_runs_in_autocast():
    @jax.custom_jvp
    def scaled(x, w):
        return jnp.tanh(x @ w)

    @scaled.defjvp
    def scaled_jvp(primals, tangents):
        x, w = primals
        tx, _ = tangents
        return scaled(x, w), 3.0 * tx @ w  # deliberately not the true derivative

    x = _normal(jax.random.key(8), (3, 4))
    w = _normal(jax.random.key(9), (4, 5))
    jaxpr = jax.make_jaxpr(autocast(scaled))(x, w)
    (call,) = eqns_named(jaxpr, "custom_jvp_call")[:1]
    inner = [e for e in iter_eqns(call.params["call_jaxpr"]) if e.primitive.name == "dot_general"]
    assert in_dtypes(inner[0]) == [np.dtype(jnp.bfloat16)] * 2
    g = jax.grad(lambda x: jnp.sum(autocast(scaled)(x, w)))(x)
    expected = 3.0 * jnp.sum(w, axis=1) * jnp.ones_like(x)
    assert rel_err(g, expected) < 1e-2


def test_custom_vjp_keeps_its_rules_and_traced_dtypes():
    @jax.custom_vjp
    def clip_grad(x):
        return jnp.exp(x) - 1.0

    clip_grad.defvjp(lambda x: (clip_grad(x), None), lambda _, ct: (jnp.clip(ct, -0.5, 0.5),))

    def f(x, w):
        return jnp.sum(clip_grad(x @ w))

    x, w = _normal(jax.random.key(10), (3, 4)), _normal(jax.random.key(11), (4, 2))
    jaxpr = jax.make_jaxpr(autocast(f))(x, w)
    (call,) = eqns_named(jaxpr, "custom_vjp_call")
    assert in_dtypes(call) == [F32]  # operand cast back to its traced dtype
    g = jax.grad(autocast(f))(x, w)
    chex.assert_trees_all_close(g, jax.grad(f)(x, w), rtol=1e-2)  # ct = 1 clipped to 0.5


def test_integer_and_bool_values_untouched():
    def f(x, idx):
        onehot = (idx[:, None] == jnp.arange(5)).astype(jnp.int32)
        counts = jnp.sum(onehot, axis=0) * 3 // 2
        mask = x > 0
        scores = jnp.where(mask, x, 0.0) @ jnp.ones((5, 5))
        return jnp.argmax(scores, axis=1), counts, jnp.sum(mask), scores

    x = _normal(jax.random.key(12), (6, 5))
    idx = jax.random.randint(jax.random.key(13), (6,), 0, 5)
    ref_jaxpr, ac_jaxpr = jax.make_jaxpr(f)(x, idx), jax.make_jaxpr(autocast(f))(x, idx)

    def int_bool_eqns(jaxpr):
        """(primitive, input dtypes, output dtypes) of equations touching no float."""
        return {
            (e.primitive.name, tuple(map(str, in_dtypes(e))), tuple(map(str, out_dtypes(e))))
            for e in iter_eqns(jaxpr)
            if not any(is_float(d) for d in in_dtypes(e) + out_dtypes(e))
        }

    def int_bool_converts(jaxpr):
        return {
            (str(in_dtypes(e)[0]), str(out_dtypes(e)[0]))
            for e in eqns_named(jaxpr, "convert_element_type")
            if in_dtypes(e) and in_dtypes(e)[0].kind in "biu"
        }

    # No new integer/boolean operation or conversion: integers and booleans are not cast.
    assert int_bool_eqns(ac_jaxpr) <= int_bool_eqns(ref_jaxpr)
    assert int_bool_converts(ac_jaxpr) <= int_bool_converts(ref_jaxpr)
    assert len(int_bool_eqns(ac_jaxpr)) >= 8
    out, ref = autocast(f)(x, idx), f(x, idx)
    for a, b in zip(out[:3], ref[:3], strict=True):
        assert a.dtype == b.dtype
    np.testing.assert_array_equal(out[1], ref[1])
    np.testing.assert_array_equal(out[2], ref[2])


def test_static_args_and_rng_keys_pass_through():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))

    model, x = Drop(), _normal(jax.random.key(14), (3, 4))
    params = jax.jit(model.init, static_argnames="train")(jax.random.key(15), x, train=False)
    rngs = {"dropout": jax.random.key(16)}
    out = autocast(model.apply)(params, x, train=True, rngs=rngs)
    ref = model.apply(params, x, train=True, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(ref) == 0)
    assert rel_err(out, ref) < 2e-2


# ----------------------------------------------------------------------------- op lists


def _mlp(x, w, b):
    return jnp.sum(jnp.tanh(x @ w + b))


def _mlp_args():
    k1, k2, k3 = jax.random.split(jax.random.key(17), 3)
    return _normal(k1, (4, 8)), _normal(k2, (8, 3)), _normal(k3, (3,))


def test_widest_rule_literals_and_bias_epilogue():
    x, w, b = _mlp_args()
    r = _normal(jax.random.key(18), (4, 3))

    @autocast(policy="p=f32,c=bf16,o=f32")  # decorator form
    def f(x, w, b, r):
        y = x @ w + b  # bias add of the matmul: stays bf16
        z = jnp.maximum(y, 0.0) * 0.5  # literals adopt bf16
        return z + r  # same-size float32 operand: widest wins

    jaxpr = jax.make_jaxpr(f)(x, w, b, r)
    bf16 = np.dtype(jnp.bfloat16)
    adds = [out_dtypes(e)[0] for e in eqns_named(jaxpr, "add")]
    assert adds == [bf16, F32]
    assert [out_dtypes(e) for e in eqns_named(jaxpr, "max", "mul")] == [[bf16], [bf16]]
    ref = f64_reference(f.__wrapped__, x, w, b, r)
    assert rel_err(jax.jit(f)(x, w, b, r), ref) < 2e-2


def test_default_lists_are_readable_data():
    lists = OpLists()
    assert {"dot_general", "conv_general_dilated"} <= lists.lower_precision
    assert {"exp", "log", "log1p", "expm1", "pow", "rsqrt", "erf_inv", "logistic"} <= lists.fp32
    assert {"reduce_sum", "reduce_max", "argmax", "cumsum", "cumlogsumexp"} <= lists.fp32
    assert isinstance(lists.fp32, frozenset) and isinstance(lists.conditional_fp32, tuple)
    with pytest.raises(AttributeError):
        lists.fp32 = frozenset()  # frozen
    assert autocast(_mlp).op_lists == lists


def test_user_override_changes_the_jaxpr():
    args = _mlp_args()
    bf16 = np.dtype(jnp.bfloat16)

    def dtypes(lists, name):
        jaxpr = jax.make_jaxpr(autocast(_mlp, op_lists=lists))(*args)
        return [in_dtypes(e) for e in eqns_named(jaxpr, name)]

    assert dtypes(OpLists(), "dot_general") == [[bf16, bf16]]
    assert dtypes(OpLists().with_removed("dot_general"), "dot_general") == [[F32, F32]]
    assert dtypes(OpLists(), "tanh") == [[bf16]]  # bias add is the matmul's epilogue
    assert dtypes(OpLists().with_added(fp32=["tanh"]), "tanh") == [[F32]]
    assert dtypes(OpLists(epilogue=frozenset()), "tanh") == [[F32]]  # widest rule
    assert dtypes(OpLists().with_added(lower_precision=[lax.reduce_sum_p]), "reduce_sum") == [
        [bf16]
    ]
    moved = OpLists().with_added(fp32=["dot_general"])
    assert "dot_general" not in moved.lower_precision
    assert dtypes(moved, "dot_general") == [[F32, F32]]


def test_conditional_fp32_on_highest_precision_matmul():
    x, w, _ = _mlp_args()

    def f(x, w):
        return jnp.matmul(x, w, precision=lax.Precision.HIGHEST)

    def dtypes(lists):
        jaxpr = jax.make_jaxpr(autocast(f, op_lists=lists))(x, w)
        return [in_dtypes(e) for e in eqns_named(jaxpr, "dot_general")]

    assert dtypes(OpLists()) == [[F32, F32]]
    bf16 = np.dtype(jnp.bfloat16)
    assert dtypes(OpLists(conditional_fp32=())) == [[bf16, bf16]]


def test_accumulation_dtype_none_uses_plain_compute_matmul():
    jaxpr = jax.make_jaxpr(autocast(_mlp, accumulation_dtype=None))(*_mlp_args())
    (dot,) = eqns_named(jaxpr, "dot_general")
    assert dot.params["preferred_element_type"] is None
    assert out_dtypes(dot) == [np.dtype(jnp.bfloat16)]
    assert not eqns_named(jaxpr, "custom_jvp_call")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"policy": "params=float32,compute=bfloat15"}, ValueError, "bfloat15"),
        ({"policy": "compute=int8"}, ValueError, "int8"),
        ({"policy": 3}, TypeError, "int"),
        ({"op_lists": {"fp32": ["exp"]}}, TypeError, "OpLists"),
        ({"accumulation_dtype": jnp.int32}, ValueError, "accumulation_dtype"),
    ],
)
def test_bad_autocast_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        autocast(_mlp, **kwargs)


def test_non_callable_fun():
    with pytest.raises(TypeError, match="callable"):
        autocast("not a function")


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: OpLists(fp32=["expp"]), ValueError, r"'expp'.*did you mean 'exp'"),
        (lambda: OpLists(fp32="exp"), TypeError, "wrap a single name"),
        (lambda: OpLists(fp32=[3]), TypeError, "3 of type int"),
        (lambda: OpLists(fp32=[""]), ValueError, "empty"),
        (lambda: OpLists(fp32=["dot_general"]), ValueError, "'dot_general'.*both"),
        (lambda: OpLists().with_added(fp32=["scan"]), ValueError, "'scan'.*recurses"),
        (lambda: OpLists(conditional_fp32=[("exp", "accuracy")]), TypeError, "triple"),
        (lambda: OpLists(conditional_fp32=[("exp", "", (1,))]), TypeError, "non-empty"),
        (lambda: OpLists(conditional_fp32=[("exp", "a", 1)]), TypeError, "tuple of parameter"),
        (lambda: OpLists().with_removed("tanhh"), ValueError, "'tanhh'"),
        (lambda: OpLists().with_added(fp32=["exp"], lower_precision=["exp"]), ValueError, "both"),
    ],
)
def test_bad_op_lists(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_exported_from_package():
    assert mpjax.autocast is autocast and mpjax.OpLists is OpLists
