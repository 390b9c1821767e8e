"""8-bit optimizer state: `low_precision_state(inner, jnp.int8)` and its blockwise codes.

Nearest rounding picks the nearest codebook value of each element (checked in float64);
stochastic rounding is unbiased and deterministic given the seed; the state takes
1 + 4 / block_size bytes per moment element (6.03 bytes per param of AdamW state with bf16
params and remainders); it trains adam, adamw, lion and adafactor; inside `loss_scaled` a
skipped step leaves it bit-identical, and a resumed run is bitwise identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax._src.scaling.blockwise8 import CODEBOOK, Blockwise8, dequantize, quantize
from tests.helpers.optim import LP_INNERS
from tests.helpers.optim import apply_update as _apply
from tests.helpers.optim import assert_bits_equal as _assert_bits_equal
from tests.helpers.optim import quadratic_run as _quadratic_run


def _moments(n: int, seed: int) -> np.ndarray:
    """Signed values spanning eight decades, zeros, and a ragged last block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 0, n)
    x[:3] = [0.0, -0.0, 0.0]
    return x.astype(np.float32)


def test_codebook_is_dense_near_the_top_and_spans_six_decades():
    assert CODEBOOK.shape == (128,) and CODEBOOK[0] == 0.0 and CODEBOOK[-1] == 1.0
    assert (np.diff(CODEBOOK) > 0).all()
    assert CODEBOOK[1] == pytest.approx(1e-6)
    assert ((CODEBOOK > 0.1) & (CODEBOOK <= 1.0)).sum() == 64


@pytest.mark.parametrize("block_size", [256, 64, 7])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nearest_picks_the_nearest_code_of_each_element(block_size, jit):
    x = _moments(1000, 0).reshape(40, 25)
    q = (jax.jit(quantize, static_argnums=1) if jit else quantize)(jnp.asarray(x), block_size)
    assert q.codes.dtype == jnp.int8 and q.codes.shape == x.shape
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (-(-x.size // block_size),)
    got = np.asarray(dequantize(q, x.shape, block_size)).astype(np.float64).reshape(-1)
    flat = x.reshape(-1).astype(np.float64)
    pad = (-flat.size) % block_size
    scale = np.abs(np.pad(flat, (0, pad))).reshape(-1, block_size).max(1)
    scale = np.where(scale > 0, scale, 1.0).repeat(block_size)[: flat.size]
    book = CODEBOOK.astype(np.float64)
    candidates = np.sign(flat)[:, None] * book[None, :] * scale[:, None]
    best = np.abs(candidates - flat[:, None]).min(1)
    err = np.abs(got - flat)
    assert (err <= best + 1e-6 * scale).all()  # the nearest, up to float32 rounding
    top = np.abs(flat) >= 0.1 * scale  # the top decade: steps of 0.9 / 64 of the scale
    assert (err[top] <= (0.45 / 64 + 1e-6) * scale[top]).all()
    # each block's largest element is kept exactly (its scale is the code 1.0)
    blocks = np.pad(flat, (0, pad)).reshape(-1, block_size)
    top = np.abs(blocks).argmax(1) + np.arange(len(blocks)) * block_size
    top = top[top < flat.size]
    np.testing.assert_array_equal(got[top], flat[top])


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = _moments(256, 1)
    key = jnp.asarray(x)
    draws = np.stack(
        [np.asarray(dequantize(quantize(key, 256, jnp.uint32(s)), x.shape)) for s in range(1500)]
    ).astype(np.float64)
    # a draw is one of the two codes around x; their mean is x within 5 standard errors
    scale = np.abs(x).max()
    a = np.abs(x.astype(np.float64)) / scale
    book = CODEBOOK.astype(np.float64)
    lo = np.clip(np.searchsorted(book, a, side="right") - 1, 0, 126)
    down, up = book[lo] * scale, book[lo + 1] * scale
    assert np.isin(np.abs(draws), np.stack([down, up]).astype(np.float32).astype(np.float64)).all()
    p = (np.abs(x) - down) / (up - down)
    se = (up - down) * np.sqrt(np.maximum(p * (1 - p), 1e-12) / len(draws))
    err = np.abs(draws.mean(0) - x.astype(np.float64))
    assert (err <= 5 * se + 1e-12 * scale).all(), (err / se).max()
    a1, a2 = quantize(key, 256, jnp.uint32(7)), jax.jit(quantize, static_argnums=1)(key, 256, 7)
    _assert_bits_equal(a1, a2)
    assert (np.asarray(a1.codes) != np.asarray(quantize(key, 256, jnp.uint32(8)).codes)).any()


def test_adamw_state_is_6_bytes_per_param_with_exact_master():
    """bf16 params + int16 remainders + 8-bit mu and nu (+ a float32 scale per 256)."""
    params = {"w": jnp.zeros((256, 128), jnp.bfloat16), "b": jnp.zeros((128,), jnp.bfloat16)}
    inner = mpjax.low_precision_state(optax.adamw(1e-3), jnp.int8)
    state = mpjax.loss_scaled(inner, master_weights="remainder").init(params)
    mu = state.inner_state.inner_state[0].mu
    assert isinstance(mu["w"], mpjax.scaling.Blockwise8)
    assert mu["w"].codes.dtype == jnp.int8 and mu["w"].codes.shape == (256, 128)
    assert mu["w"].scales.shape == (128,) and mu["b"].scales.shape == (1,)
    n = sum(x.size for x in jax.tree.leaves(params))
    big = sum(x.nbytes for x in jax.tree.leaves((params, state)) if x.ndim)  # no counters
    assert big == 6 * n + 2 * 4 * (128 + 1)  # 6 bytes each, and two scales per block


@pytest.mark.parametrize("name", sorted(LP_INNERS))
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_int8_state_trains(name, rounding):
    f32_loss, _ = _quadratic_run(LP_INNERS[name]())
    tx = mpjax.low_precision_state(LP_INNERS[name](), jnp.int8, rounding=rounding, block_size=32)
    loss, state = _quadratic_run(tx)
    leaves = jax.tree.leaves(state.inner_state, is_leaf=lambda x: isinstance(x, Blockwise8))
    assert any(isinstance(x, Blockwise8) for x in leaves)
    # every floating array of the inner state is stored as codes (scalars stay as they are)
    for x in leaves:
        if isinstance(x, Blockwise8):
            assert x.codes.dtype == jnp.int8 and x.scales.dtype == jnp.float32
        else:
            assert x.ndim == 0 or not jnp.issubdtype(x.dtype, jnp.floating)
    start, _ = _quadratic_run(LP_INNERS[name](), steps=0)
    assert loss < 0.5 * start and abs(loss - f32_loss) <= 0.1 * start


def test_int8_state_inside_loss_scaled_skip_is_bit_identical():
    inner = mpjax.low_precision_state(optax.adamw(1e-2), jnp.int8)
    tx = mpjax.loss_scaled(inner, master_weights="remainder")
    params = {"w": jnp.asarray(np.random.default_rng(4).standard_normal((8, 40)), jnp.bfloat16)}
    state = tx.init(params)
    good = {"w": jnp.asarray(np.random.default_rng(5).standard_normal((8, 40)), jnp.bfloat16)}
    params, state = _apply(tx, params, state, good)
    before = (params, state.inner_state, state.master)
    params2, state2 = _apply(tx, params, state, {"w": good["w"].at[3, 3].set(jnp.inf)})
    assert bool(state2.skipped)
    _assert_bits_equal((params2, state2.inner_state, state2.master), before)


def test_int8_bad_arguments_name_the_culprit():
    with pytest.raises(ValueError, match="block_size"):
        mpjax.low_precision_state(optax.adam(1e-3), jnp.int8, block_size=0)
    with pytest.raises(TypeError, match="floating dtype or int8"):
        mpjax.low_precision_state(optax.adam(1e-3), dtype=jnp.int16, rounding="nearest")


def test_int8_rounds_to_nearest_by_default():
    def run(**kw):
        return _quadratic_run(mpjax.low_precision_state(optax.adam(1e-2), jnp.int8, **kw), 5)[1]

    _assert_bits_equal(run(), run(rounding="nearest"))
    stochastic = run(rounding="stochastic")
    codes = lambda s: np.asarray(s.inner_state[0].mu["w"].codes)  # noqa: E731
    assert (codes(stochastic) != codes(run())).any()
