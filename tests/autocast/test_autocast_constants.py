"""`mpjax.autocast` keeps constants in range: a float32 `finfo.min` attention mask stays finite in
bfloat16/float16, and a padded Flax Transformer (lm1b-style) trains under autocast."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax._src.autocast.rules import cast
from tests.helpers.numerics import f64_reference, tree_rel_err
from tests.helpers.policy import TOL, rel_error

LOW = ["bfloat16", "float16"]
F32_MIN = jnp.finfo(jnp.float32).min
F32_MAX = jnp.finfo(jnp.float32).max


def policy_for(compute):
    return f"params=float32,compute={compute},output=float32"


# ----------------------------------------------------------------------------- the cast helper


def wide_range(seed, dtype, n=257):
    """Signed float32 values log-uniform over 1e-30..3e38, a quarter of them between `dtype`'s
    largest finite value and float32's, float32's min and max, and inf, -inf and NaN at the
    first, middle and last elements."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.uniform(np.log(1e-30), np.log(3e38), n))
    top = rng.uniform(float(jnp.finfo(dtype).max), float(F32_MAX), n // 4)
    x[1 : 1 + n // 4] = top
    x = (x * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    x[-3], x[-2] = F32_MAX, -F32_MAX
    x[0], x[n // 2], x[-1] = np.inf, np.nan, -np.inf
    return x


@pytest.mark.parametrize("traced", [False, True], ids=["numpy", "traced"])
@pytest.mark.parametrize("dtype", LOW)
def test_saturating_cast_changes_values_by_rounding_only(dtype, traced):
    x = wide_range(len(dtype) + traced, dtype)
    if traced:
        got = np.asarray(jax.jit(lambda v: cast(v, dtype, saturate=True))(x))
    else:
        got = cast(x, dtype, saturate=True)
    assert got.dtype == jnp.dtype(dtype)
    limit = float(jnp.finfo(dtype).max)
    x64, got64 = x.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(x64)
    assert np.isfinite(got64[finite]).all()  # no finite value became inf
    in_range = finite & (np.abs(x64) <= limit)
    np.testing.assert_array_equal(got64[in_range], x64[in_range].astype(dtype).astype(np.float64))
    beyond = finite & (np.abs(x64) > limit)
    assert beyond.sum() > 10
    np.testing.assert_array_equal(got64[beyond], np.sign(x64[beyond]) * limit)
    np.testing.assert_array_equal(got64[~finite], x64[~finite])  # inf, -inf, NaN stay


@pytest.mark.parametrize("dtype", LOW)
def test_plain_cast_still_overflows(dtype):
    """Without `saturate` (values computed from inputs) an overflow stays an IEEE inf."""
    x = np.asarray([F32_MAX, -F32_MAX, 1.0], np.float32)
    assert np.isinf(cast(x, dtype)[:2]).all()
    assert np.isinf(np.asarray(jax.jit(lambda v: cast(v, dtype))(x))[:2]).all()


# ----------------------------------------------------------------------------- the reproducer


def masked_softmax(q, k):
    s = jnp.where(jnp.zeros((q.shape[0], k.shape[0]), bool), q @ k.T, F32_MIN)
    return jax.nn.softmax(s)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("compute", LOW)
def test_issue_reproducer_fully_masked_rows_are_uniform(compute, use_jit):
    q = jax.random.normal(jax.random.key(0), (2, 3))
    fn = mpjax.autocast(masked_softmax, policy_for(compute))
    out = np.asarray((jax.jit(fn) if use_jit else fn)(q, q))
    np.testing.assert_array_equal(out, np.full((2, 2), 0.5, np.float32))  # float32 gives this


KEY_VALID = np.ones((2, 1, 5), bool)
KEY_VALID[0, 0, 3:] = False  # sequence 0: two padding keys
KEY_VALID[1] = False  # sequence 1: all padding, so every query row is fully masked


def captured_bias_attention(q, k):
    """A key-padding bias captured as a numpy array (a jaxpr const), added to the scores."""
    bias = np.where(KEY_VALID, 0.0, np.finfo(np.float32).min).astype(np.float32)
    return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) + bias, axis=-1)


@pytest.mark.parametrize("compute", LOW)
def test_captured_constant_array_saturates(compute):
    k1, k2 = jax.random.split(jax.random.key(1))
    q = jax.random.normal(k1, (2, 5, 8)) * 3.0
    k = jax.random.normal(k2, (2, 5, 8)) * 3.0
    assert jax.make_jaxpr(captured_bias_attention)(q, k).consts  # the bias is a captured const
    out = np.asarray(jax.jit(mpjax.autocast(captured_bias_attention, policy_for(compute)))(q, k))
    ref = f64_reference(captured_bias_attention, q, k)
    assert np.isfinite(out).all()  # old code: the bias became -inf, sequence 1 NaN
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-2)
    np.testing.assert_array_equal(out[0, :, 3:], 0.0)
    assert rel_error(out[0], ref[0]) < TOL[compute]
    if compute == "bfloat16":  # -3.39e38 absorbs the scores, as -3.40e38 does in float32;
        # float16's -65504 does not (its spacing there is 32), so its rows are finite, not uniform
        np.testing.assert_array_equal(out[1], np.full((5, 5), 0.2, np.float32))


def test_constant_saturates_inside_a_lower_precision_op():
    """A huge constant operand of a matmul becomes float16's max, not inf (so 0 * c stays 0)."""
    c = np.asarray([[1e30, 0.0], [0.0, 1.0]], np.float32)
    x = jnp.asarray([[0.0, 1.0]], jnp.float32)
    out = np.asarray(mpjax.autocast(lambda a: a @ c, policy_for("float16"))(x))
    np.testing.assert_array_equal(out, [[0.0, 1.0]])  # inf * 0 would make NaN


def test_input_values_still_overflow_to_inf():
    """Documented choice: a finite float32 activation beyond float16's range becomes inf (an
    overflow loss scaling must see), not a silently clipped value."""
    x = jnp.asarray([[1e6], [-1e6], [3.0]], jnp.float32)
    w = jnp.ones((1, 1), jnp.float32)
    out = np.asarray(mpjax.autocast(lambda a, b: a @ b, policy_for("float16"))(x, w))
    np.testing.assert_array_equal(out[:, 0], [np.inf, -np.inf, 3.0])


# ----------------------------------------------------------------------------- a padded Transformer

VOCAB, LENGTH, WIDTH, HEADS = 24, 10, 32, 4


class EncoderBlock(nn.Module):
    """lm1b/wmt-style pre-LN block: LayerNorm, masked self-attention, LayerNorm, MLP."""

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=WIDTH)(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(2 * WIDTH)(h)
        return x + nn.Dense(WIDTH)(nn.gelu(h))


class PaddedEncoder(nn.Module):
    """Token + learned position embeddings, two blocks, logits; token 0 is padding."""

    @nn.compact
    def __call__(self, tokens):
        mask = nn.make_attention_mask(tokens > 0, tokens > 0)  # padding queries: no key at all
        embed = nn.Embed(VOCAB, WIDTH)
        pos = self.param("pos", nn.initializers.normal(0.02), (LENGTH, WIDTH))
        x = embed(tokens) + pos[: tokens.shape[1]]
        for _ in range(2):
            x = EncoderBlock()(x, mask)
        x = nn.LayerNorm()(x)
        return nn.Dense(VOCAB)(x)


def padded_batch(seed, batch=8):
    """Random tokens, each row padded (token 0) after a random length; the last row is all
    padding, so every one of its queries is fully masked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, (batch, LENGTH))
    lengths = rng.integers(2, LENGTH, batch)
    lengths[-1] = 0
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    targets = np.roll(tokens, -1, axis=1) * (tokens > 0)
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32)


def make_loss(forward):
    """Padding-weighted next-token cross entropy; returns `(loss, logits)`."""

    def loss_fn(params, tokens, targets):
        logits = forward({"params": params}, tokens)
        weights = (targets > 0).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        return (nll * weights).sum() / weights.sum(), logits

    return loss_fn


@pytest.fixture(scope="module")
def encoder():
    """The model, its params, a padded batch and the float64 logits and gradients (once)."""
    model = PaddedEncoder()
    tokens, targets = padded_batch(1)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    grad_fn = jax.grad(make_loss(model.apply), has_aux=True)
    ref_grads, ref_logits = f64_reference(grad_fn, params, tokens, targets)
    return model, params, (tokens, targets), ref_logits, ref_grads


@pytest.mark.parametrize("compute", LOW)
def test_padded_attention_matches_float64(encoder, compute):
    """Logits (padding rows included) and float32 gradients of the padded model vs float64."""
    model, params, (tokens, targets), ref_logits, ref_grads = encoder
    loss_fn = make_loss(mpjax.autocast(model.apply, policy_for(compute)))
    grads, logits = jax.jit(jax.grad(loss_fn, has_aux=True))(params, tokens, targets)
    assert np.isfinite(np.asarray(logits)).all()  # padding rows too (old code: NaN)
    assert rel_error(logits, ref_logits) < TOL[compute]
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32 and np.isfinite(np.asarray(g)).all()
    assert tree_rel_err(grads, ref_grads) < 3 * TOL[compute]


@pytest.mark.slow
@pytest.mark.parametrize("compute", LOW)
def test_padded_transformer_trains_under_autocast(encoder, compute):
    """bf16 with plain adam; fp16 with `loss_scaled` (dynamic scale): every step finite, none
    skipped, and the loss falls."""
    model, params, *_ = encoder
    loss_fn = make_loss(mpjax.autocast(model.apply, policy_for(compute)))
    if compute == "float16":
        tx = mpjax.loss_scaled(optax.adam(3e-3))
    else:
        tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens, targets):
        def scaled(p):
            loss, _ = loss_fn(p, tokens, targets)
            return (mpjax.scale_loss(loss, opt_state) if compute == "float16" else loss), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        finite = mpjax.all_finite(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, finite

    tokens, targets = padded_batch(2)
    losses = []
    for _ in range(8):
        params, opt_state, loss, finite = step(params, opt_state, tokens, targets)
        assert np.isfinite(float(loss)) and bool(finite)
        losses.append(float(loss))
    if compute == "float16":
        assert int(mpjax.scaling_metrics(opt_state)["skipped_steps"]) == 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    assert losses[-1] < 0.9 * losses[0], losses
