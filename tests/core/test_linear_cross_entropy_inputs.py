"""`mpjax.nn.linear_cross_entropy` on the inputs at the edges: labels outside the
vocabulary, -inf logits, label and activation dtypes, empty and scalar shapes, extreme
magnitudes, and the compute dtype a policy's hidden states give it.

Every value is compared with optax on the full logits, or with the float64 reference
(`tests/helpers/lce.py`); none may depend on `chunk_size`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax.nn import linear_cross_entropy
from tests.helpers.lce import assert_gemms_bf16, reference

D, V = 8, 37
F32 = jnp.float32
FULL = 10**6  # a chunk holding the whole vocabulary in one tile


def _xk(n, dtype=F32, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, D)) * scale, dtype)
    k = jnp.asarray(rng.standard_normal((D, V)) * 0.5, dtype)
    return x, k


def _value_and_grads(x, k, labels, bias=None, *, jit=True, **kwargs):
    def loss(x, k, bias):
        return linear_cross_entropy(x, k, labels, bias=bias, **kwargs)

    fn = jax.value_and_grad(loss, (0, 1, 2) if bias is not None else (0, 1))
    return (jax.jit(fn) if jit else fn)(x, k, bias)


@pytest.mark.parametrize("chunk", [1, 2, 5, 24, FULL])
def test_labels_outside_the_vocabulary_give_nan_rows_like_optax(chunk):
    """-100, vocab and vocab + 7 without `ignore_index`: NaN (optax's value), the rows'
    gradients NaN too; the other rows' gradients are the reference's."""
    x, k = _xk(8)
    labels = jnp.array([3, -100, 5, V, 0, V + 7, 36, 2])
    bad = np.array([False, True, False, True, False, True, False, False])
    want_rows = optax.softmax_cross_entropy_with_integer_labels((x @ k).astype(F32), labels)
    assert np.isnan(want_rows[bad]).all() and np.isfinite(want_rows[~bad]).all()
    value, (gx, gk) = _value_and_grads(x, k, labels, chunk_size=chunk, dtype=F32)
    assert np.isnan(value)
    np.testing.assert_array_equal(np.isnan(gx).all(1), bad)
    assert np.isfinite(gx[~bad]).all() and np.isnan(gk).all()
    # the counted rows' gradients: those of the mean over all 8 rows
    good = np.where(bad, 0, labels)
    _, want_gx, _, _ = reference(x, k, good)
    np.testing.assert_allclose(gx[~bad], want_gx[~bad], atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, FULL])
def test_ignored_labels_stay_ignored_whatever_the_others(chunk):
    """`ignore_index=-100` ignores -100 (no NaN); vocab, still counted, is NaN."""
    x, k = _xk(6)
    labels = jnp.array([3, -100, 5, -100, 0, 2])
    value, (gx, gk) = _value_and_grads(x, k, labels, chunk_size=chunk, ignore_index=-100, dtype=F32)
    want, want_gx, want_gk, _ = reference(x, k, labels, ignore_index=-100)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    np.testing.assert_allclose(gx, want_gx, atol=1e-6)
    np.testing.assert_allclose(gk, want_gk, atol=1e-6)
    labels = labels.at[0].set(V)
    assert np.isnan(linear_cross_entropy(x, k, labels, ignore_index=-100, dtype=F32))


@pytest.mark.parametrize("chunk", [1, 2, 5, 24, FULL])
def test_minus_inf_bias_matches_the_float64_reference(chunk):
    """A -inf bias on the first 31 of 37 entries (the first tile all -inf at chunk sizes 1,
    2 and 5 of 6 tokens) and on entry 33: loss and the gradients of x, kernel and bias."""
    x, k = _xk(6)
    bias = jnp.zeros((V,), F32).at[:31].set(-jnp.inf).at[33].set(-jnp.inf)
    labels = jnp.array([31, 32, 34, 35, 36, 31])
    value, grads = _value_and_grads(x, k, labels, bias, chunk_size=chunk, dtype=F32)
    want = reference(x, k, labels, bias=bias)
    np.testing.assert_allclose(value, want[0], rtol=1e-6)
    for got, ref in zip(grads, want[1:], strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, FULL])
def test_a_row_of_all_minus_inf_logits_is_nan_like_optax_unless_ignored(chunk):
    """Every logit -inf: optax gives a NaN loss and NaN gradients, and so does this; an
    ignored row of them contributes nothing (no NaN through the gradient)."""
    x, k = _xk(4)
    bias = jnp.full((V,), -jnp.inf, F32)
    labels = jnp.array([1, 2, 3, 4])
    logits = x @ k + bias
    want = jax.value_and_grad(
        lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, labels).mean()
    )(logits)
    assert np.isnan(want[0]) and np.isnan(want[1]).all()
    value, grads = _value_and_grads(x, k, labels, bias, chunk_size=chunk, dtype=F32)
    assert np.isnan(value) and all(np.isnan(g).all() for g in grads)
    ignored = jnp.full((4,), -1)
    value, grads = _value_and_grads(
        x, k, ignored, bias, chunk_size=chunk, ignore_index=-1, dtype=F32
    )
    assert value == 0.0 and all(not np.asarray(g).any() for g in grads)


def test_labels_of_any_integer_dtype_are_compared_before_a_cast():
    """uint8 labels with a 300-class vocabulary and `ignore_index=-100` (which uint8 cannot
    hold: label 156 is not ignored), int64 labels past 2**32 (not wrapped into range)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, D)), F32)
    k = jnp.asarray(rng.standard_normal((D, 300)) * 0.5, F32)
    labels = np.array([156, 255, 0, 7], np.uint8)
    value = linear_cross_entropy(x, k, labels, ignore_index=-100, dtype=F32)
    np.testing.assert_allclose(value, reference(x, k, labels)[0], rtol=1e-6)
    wrapped = np.array([156, 2**32 + 7, 0, 7], np.int64)  # int32 would read 2**32 + 7 as 7
    assert np.isnan(linear_cross_entropy(x, k, wrapped, dtype=F32))


@pytest.mark.parametrize(
    ("dtype", "jit"),
    [(jnp.bfloat16, True), (jnp.float16, False), (F32, True)],  # eager (slower): one case
    ids=["bf16-jit", "f16-eager", "f32-jit"],
)
def test_hidden_dtypes_with_a_float32_kernel(dtype, jit):
    """bfloat16 / float16 hidden states and a float32 kernel: dtype=None runs the GEMMs in
    the hidden states' dtype; float32 ones need dtype= (both float32 is refused)."""
    x, k = _xk(5, dtype)
    k = k.astype(F32)
    labels = jnp.array([0, 9, 18, 27, 36])
    compute = None if dtype != F32 else F32
    value, (gx, gk) = _value_and_grads(x, k, labels, chunk_size=3, dtype=compute, jit=jit)
    want, want_gx, want_gk, _ = reference(x, k.astype(dtype), labels)
    tol = 1e-6 if dtype == F32 else 2**-7
    np.testing.assert_allclose(value, want, rtol=1e-5)
    assert gx.dtype == dtype and gk.dtype == F32
    np.testing.assert_allclose(gx, want_gx, atol=tol * np.abs(want_gx).max())
    np.testing.assert_allclose(gk, want_gk, atol=tol * np.abs(want_gk).max())


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_an_empty_batch_is_a_zero_loss_with_zero_gradients(jit):
    x, k = _xk(0, jnp.bfloat16)
    labels = jnp.zeros((0,), jnp.int32)
    value, (gx, gk) = _value_and_grads(x, k, labels, chunk_size=4, jit=jit)
    assert value == 0.0 and gx.shape == (0, D) and gk.shape == (D, V) and not gk.any()


@pytest.mark.parametrize(
    ("scale", "dtype"), [(1e30, F32), (1e30, jnp.bfloat16), (1e-30, F32)], ids=str
)
def test_extreme_magnitudes_match_the_float64_reference(scale, dtype):
    """Hidden states of 1e30 (logits near 1e30, a one-hot softmax) and of 1e-30 (near-uniform)."""
    x, k = _xk(6, dtype, scale=scale)
    labels = jnp.array([0, 5, 10, 20, 30, 36])
    value, (gx, gk) = _value_and_grads(x, k, labels, chunk_size=2, dtype=dtype)
    want, want_gx, want_gk, _ = reference(x, k, labels)
    np.testing.assert_allclose(value, want, rtol=2**-7 if dtype != F32 else 1e-5)
    np.testing.assert_allclose(gx, want_gx, atol=2**-7 * np.abs(want_gx).max())
    np.testing.assert_allclose(gk, want_gk, atol=2**-7 * np.abs(want_gk).max(), rtol=2**-7)


@pytest.mark.parametrize(
    ("x_shape", "k_shape", "label_shape", "match"),
    [
        ((), (D, V), (), r"x must be \[\.\.\., d\]"),
        ((3, D), (D, 0), (3,), r"vocab >= 1, got shape \(8, 0\)"),
        ((3, 0), (0, V), (3,), r"d >= 1 and vocab >= 1, got shape \(0, 37\)"),
        ((3, D), (D,), (3,), r"kernel must be \[d, vocab\]"),
    ],
)
def test_empty_or_scalar_shapes_name_the_argument(x_shape, k_shape, label_shape, match):
    x, k = jnp.ones(x_shape, F32), jnp.ones(k_shape, F32)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(x, k, jnp.zeros(label_shape, jnp.int32), dtype=F32)


def test_one_token_of_a_scalar_label():
    x, k = _xk(1)
    value = linear_cross_entropy(x[0], k, jnp.array(4), dtype=F32)
    np.testing.assert_allclose(value, reference(x, k, [4])[0], rtol=1e-6)


def test_dtype_takes_the_policy_aliases():
    x, k = _xk(3)
    labels = jnp.array([1, 2, 3])
    got = linear_cross_entropy(x, k, labels, dtype="bf16")
    np.testing.assert_array_equal(got, linear_cross_entropy(x, k, labels, dtype=jnp.bfloat16))
    with pytest.raises(ValueError, match=r"dtype: 'bf17' is not a dtype; use one of"):
        linear_cross_entropy(x, k, labels, dtype="bf17")


@pytest.mark.parametrize(
    ("x_dtype", "k_dtype"), [(F32, F32), (jnp.float16, jnp.bfloat16)], ids=["f32", "f16-bf16"]
)
def test_dtype_none_refuses_to_pick_float32_or_between_two_half_dtypes(x_dtype, k_dtype):
    x, k = _xk(3)
    with pytest.raises(ValueError, match="dtype=None with x .* names no compute dtype"):
        linear_cross_entropy(x.astype(x_dtype), k.astype(k_dtype), jnp.array([1, 2, 3]))


class _Body(nn.Module):
    """A language model's body: its final hidden states."""

    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(D)(x))


def _policy_step(spec, dtype, **apply_policy_kwargs):
    """The loss of `apply_policy(_Body(), spec)`'s hidden states and a float32 head kernel,
    as the memory guide writes it, and the params."""
    model = mpjax.apply_policy(_Body(), spec, **apply_policy_kwargs)
    x, head = _xk(6)
    params = {"body": _Body().init(jax.random.key(0), x)["params"], "head": head}
    labels = jnp.array([0, 5, 10, 20, 30, 36])

    def loss(p):
        hidden = model.apply({"params": p["body"]}, x)
        return linear_cross_entropy(hidden, p["head"], labels, chunk_size=FULL, dtype=dtype)

    return loss, params


@pytest.mark.parametrize(
    "spec", ["params=float32,compute=bfloat16,output=float32", "params=float32,compute=bfloat16"]
)
def test_apply_policy_hidden_states_cannot_run_the_head_in_float32_unasked(spec):
    """The root's output leaves `apply_policy` in float32 (`output=float32`, or the default
    `final_output_dtype`), the head kernel is a float32 param: dtype=None raises, and
    dtype=policy.compute_dtype runs the head's three GEMMs (and the recomputed forward) in
    bfloat16."""
    loss, params = _policy_step(spec, None)
    with pytest.raises(ValueError, match="dtype=policy.compute_dtype"):
        jax.grad(loss)(params)
    loss, params = _policy_step(spec, mpjax.get_policy(spec).compute_dtype)
    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    assert_gemms_bf16(text, only=f"x{V}x")  # the head's: its tile is the whole vocabulary


def test_bf16_hidden_states_and_a_float32_kernel_run_the_head_in_bf16_with_dtype_none():
    """`final_output_dtype=None` keeps the hidden states bfloat16; with a float32 param
    kernel the 16-bit one is the GEMMs' dtype (their promoted float32 was)."""
    defaults = dataclasses.replace(mpjax.DEFAULTS, final_output_dtype=None)
    loss, params = _policy_step("params=float32,compute=bfloat16", None, defaults=defaults)
    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    assert_gemms_bf16(text, only=f"x{V}x")


def test_autocast_with_dtype_none_refuses_its_float32_trace():
    x, k = _xk(3)
    cast = mpjax.autocast(
        lambda x, k: linear_cross_entropy(x, k, jnp.array([1, 2, 3])),
        "params=float32,compute=bfloat16,output=float32",
    )
    with pytest.raises(ValueError, match="autocast"):
        cast(x, k)
