"""mpjax.pallas.channel_stats: interpret-mode kernel vs the jnp reference vs float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax._src.kernels import common
from mpjax.pallas import channel_stats

SHAPES = [(2, 3, 5, 6), (1, 9, 8, 300)]  # one ragged tile; 5 x 2 ragged tiles


@functools.partial(jax.jit, static_argnames="impl")
def _stats_and_grad(y, w, impl):
    def f(y):
        s, ss = channel_stats(y, impl=impl)
        return jnp.sum(s * w) + jnp.sum(ss * w * w), (s, ss)

    return jax.grad(f, has_aux=True)(y)


def _reference64(y, w):
    x = np.asarray(y, np.float64).reshape(-1, y.shape[-1])
    w = np.asarray(w, np.float64)
    dy = w + 2 * x * w * w
    return x.sum(0), (x * x).sum(0), np.abs(x).sum(0), (x * x).sum(0), (dy, np.abs(w) + np.abs(dy))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_matches_reference_and_float64(dtype, shape):
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.standard_normal(shape) + 0.5, dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    dy, (s, ss) = _stats_and_grad(y, w, "interpret")
    xdy, (xs, xss) = _stats_and_grad(y, w, "xla")
    rs, rss, mag_s, mag_ss, rdy = _reference64(y, w)
    assert s.dtype == ss.dtype == jnp.float32 and s.shape == (shape[-1],)
    for got, want, mag in [(s, rs, mag_s), (ss, rss, mag_ss), (xs, rs, mag_s), (xss, rss, mag_ss)]:
        assert np.max(np.abs(np.asarray(got, np.float64) - want) / mag) < 1e-6
    # The cotangent of y is one float32 expression rounded to y's dtype, as in the reference.
    assert dy.dtype == dtype
    np.testing.assert_array_equal(dy, xdy)
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    rdy, mag = rdy
    assert np.max(np.abs(np.asarray(dy, np.float64).reshape(rdy.shape) - rdy) / mag) < tol


def test_loops_over_row_groups(monkeypatch):
    monkeypatch.setattr(common, "MAX_ROW_GROUPS", 2)  # 5 row blocks: 2 programs x 3 steps
    rng = np.random.default_rng(1)
    y = jnp.asarray(rng.standard_normal((1, 9, 8, 300)), jnp.bfloat16)
    s, ss = jax.jit(functools.partial(channel_stats, impl="interpret"))(y)
    rs, rss, mag_s, mag_ss, _ = _reference64(y, np.zeros(300))
    assert np.max(np.abs(np.asarray(s, np.float64) - rs) / mag_s) < 1e-6
    assert np.max(np.abs(np.asarray(ss, np.float64) - rss) / mag_ss) < 1e-6


def test_non_finite_values_reach_the_sums():
    y = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 5, 6)), jnp.float32)
    y = y.at[0, 0, 0, 0].set(jnp.inf).at[1, 1, 2, 3].set(jnp.nan).at[-1, -1, -1, -1].set(-jnp.inf)
    s, ss = channel_stats(y, impl="interpret")
    xs, xss = channel_stats(y, impl="xla")
    np.testing.assert_allclose(s, xs, rtol=1e-6)  # inf/NaN in the same places
    np.testing.assert_allclose(ss, xss, rtol=1e-6)
    assert np.isnan(s[3]) and np.isnan(ss[3]) and np.isposinf(s[0]) and np.isneginf(s[5])
    assert np.isposinf(ss[5]) and np.isfinite(s[1]) and np.isfinite(ss[1])


def test_auto_on_cpu_and_bad_input():
    y = jnp.asarray(np.random.default_rng(3).standard_normal((4, 5)), jnp.float32)
    xla = jax.jit(functools.partial(channel_stats, impl="xla"))
    for a, b in zip(jax.jit(channel_stats)(y), xla(y), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="y must be floating"):
        channel_stats(jnp.ones((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="cannot run on these inputs"):
        channel_stats(jnp.ones((0, 4)), impl="pallas")
