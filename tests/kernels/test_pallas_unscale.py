"""mpjax.pallas.unscale_and_check: interpret-mode kernel vs XLA vs a float64 reference."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax._src.kernels import unscale
from mpjax._src.kernels.gpu_target import abstract_gpu
from mpjax.pallas import unscale_and_check, xla_unscale_and_check

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Ragged sizes: a 1-element leaf, sizes off powers of two, several blocks of 4096 + a tail.
SHAPES = [(1,), (3,), (5, 7), (130,), (33, 70), (2 * unscale.BLOCK + 5,)]


# Shared, so that tests with the same shapes compile once.
_interpret = jax.jit(functools.partial(unscale_and_check, impl="interpret"))
_xla = jax.jit(xla_unscale_and_check)


def _grads(rng, dtype, shapes=SHAPES):
    return {f"g{i}": jnp.asarray(rng.standard_normal(s) * 100, dtype) for i, s in enumerate(shapes)}


def _reference(grads, scale):
    """float64 numpy: g / scale, and whether all are finite."""
    out = {k: np.asarray(v, np.float64) / np.float64(scale) for k, v in grads.items()}
    return out, all(np.all(np.isfinite(v)) for v in out.values())


@pytest.mark.parametrize(
    "dtype,use_jit",
    [(jnp.float32, True), (jnp.bfloat16, True), (jnp.float16, True), (jnp.bfloat16, False)],
)
def test_matches_xla_and_float64(dtype, use_jit):
    rng = np.random.default_rng(0)
    grads = _grads(rng, dtype)
    fn = _interpret if use_jit else functools.partial(unscale_and_check, impl="interpret")
    # A power-of-two scale (what DynamicLossScale produces): bit-identical to the XLA path.
    scale = jnp.float32(2.0**13)
    out, finite = fn(grads, scale)
    xla_out, xla_finite = _xla(grads, scale)
    chex.assert_trees_all_equal(out, xla_out)
    assert bool(finite) and bool(xla_finite)
    # Any scale: within float32 rounding of the float64 quotient.
    out, finite = fn(grads, jnp.float32(1000.0))
    ref, ref_finite = _reference(grads, 1000.0)
    assert bool(finite) and ref_finite
    for k in grads:
        assert out[k].dtype == jnp.float32 and out[k].shape == grads[k].shape
        np.testing.assert_allclose(np.asarray(out[k], np.float64), ref[k], rtol=2.5e-7)


@pytest.mark.parametrize("scale", [3.0, 1000.0, 2.0**-126, 2.0**126, 2.0**127, 3.0e38])
def test_every_path_unscales_by_the_rounded_reciprocal_bit_for_bit(scale):
    # g * (1 / scale) with the reciprocal rounded once (GradScaler's arithmetic), the same in
    # the kernel, the XLA reference, unscale_tree and loss_scaled on every jax version (XLA
    # rewrites g / scale into this product on some versions only). Above 2**126 the reciprocal
    # is subnormal and would be flushed to zero: the gradients would silently read 0.
    rng = np.random.default_rng(9)
    magnitude = 1e30 if scale >= 1 else 1e-2  # results stay finite and normal
    g = {"a": jnp.asarray((rng.standard_normal(300) * magnitude).astype(np.float32))}
    s = jnp.float32(scale)
    big = scale > 2.0**126
    want = (np.asarray(g["a"]) * np.float32(0.25 if big else 1)) * (
        np.float32(1) / (np.float32(scale) * np.float32(0.25 if big else 1))
    )
    exact = np.asarray(g["a"], np.float64) / np.float64(np.float32(scale))
    np.testing.assert_allclose(want, exact, rtol=2.5e-7)  # the reference itself
    paths = {
        "interpret": lambda: unscale_and_check(g, s, impl="interpret")[0]["a"],
        "interpret-jit": lambda: _interpret(g, s)[0]["a"],
        "xla": lambda: xla_unscale_and_check(g, s)[0]["a"],
        "xla-jit": lambda: jax.jit(xla_unscale_and_check)(g, s)[0]["a"],
        "unscale_tree-jit": lambda: jax.jit(mpjax.scaling.unscale_tree)(g, s)["a"],
    }
    for name, run in paths.items():
        np.testing.assert_array_equal(np.asarray(run()), want, err_msg=name)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["first", "middle", "last", "tiny"])
def test_non_finite_anywhere_flips_the_flag(where, bad):
    rng = np.random.default_rng(1)
    grads = _grads(rng, jnp.bfloat16, [(2 * unscale.BLOCK + 5,), (3,), (130,)])
    big = grads["g0"]
    if where == "tiny":
        grads["g1"] = grads["g1"].at[2].set(bad)
    else:
        i = {"first": 0, "middle": big.size // 2, "last": big.size - 1}[where]
        grads["g0"] = big.at[i].set(bad)
    out, finite = _interpret(grads, jnp.float32(8.0))
    xla_out, xla_finite = _xla(grads, jnp.float32(8.0))
    assert not bool(finite) and not bool(xla_finite)
    chex.assert_trees_all_equal(out, xla_out)


def test_overflow_on_unscale_flips_the_flag():
    # Finite float32 gradients whose unscaled value overflows (scale < 1) are not finite.
    grads = {"a": jnp.full((5,), 3e38, jnp.float32), "b": jnp.ones((3,), jnp.float32)}
    _, finite = unscale_and_check(grads, jnp.float32(0.5), impl="interpret")
    assert not bool(finite)
    _, finite = unscale_and_check(grads, jnp.float32(2.0), impl="interpret")
    assert bool(finite)


def test_many_leaves_take_several_launches_and_mixed_dtypes(monkeypatch):
    # 64 leaves per launch in production; 4 here keeps interpret mode cheap.
    monkeypatch.setattr(unscale, "MAX_LEAVES_PER_CALL", 4)
    rng = np.random.default_rng(2)
    grads = [jnp.asarray(rng.standard_normal(1 + 37 * i), DTYPES[i % 3]) for i in range(10)]
    fn = jax.jit(functools.partial(unscale_and_check, impl="interpret"))
    out, finite = fn(grads, jnp.float32(4.0))
    chex.assert_trees_all_equal((out, finite), _xla(grads, jnp.float32(4.0)))
    assert bool(finite)
    grads[-1] = grads[-1].at[0].set(jnp.nan)  # in the third launch only
    assert not bool(fn(grads, jnp.float32(4.0))[1])
    lowered = jax.jit(functools.partial(unscale_and_check, impl="pallas"))
    with abstract_gpu():  # jax >= 0.11: name the GPU to lower for
        text = lowered.trace(grads, jnp.float32(4.0)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_non_floating_and_empty_leaves_pass_through():
    grads = {
        "step": jnp.arange(3, dtype=jnp.int32),
        "empty": jnp.zeros((0, 4), jnp.bfloat16),
        "w": jnp.asarray([1.0, 2.0, -3.0], jnp.float16),
    }
    out, finite = unscale_and_check(grads, jnp.float32(2.0), impl="interpret")
    chex.assert_trees_all_equal((out, finite), _xla(grads, jnp.float32(2.0)))
    assert out["step"] is grads["step"]
    assert out["empty"].shape == (0, 4) and out["empty"].dtype == jnp.float32
    np.testing.assert_array_equal(out["w"], np.asarray([0.5, 1.0, -1.5], np.float32))
    _, finite = unscale_and_check({"i": jnp.arange(3)}, jnp.float32(2.0), impl="interpret")
    assert bool(finite)


def test_float64_leaves_stay_float64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        grads = {"d": jnp.asarray(rng.standard_normal(7)), "s": jnp.asarray(rng.standard_normal(5))}
        grads["s"] = grads["s"].astype(jnp.float32)
        out, finite = unscale_and_check(grads, jnp.float32(3.0), impl="interpret")
        assert out["d"].dtype == jnp.float64 and out["s"].dtype == jnp.float32
        np.testing.assert_allclose(out["d"], np.asarray(grads["d"]) / 3.0, rtol=1e-15)
        chex.assert_trees_all_equal((out, finite), xla_unscale_and_check(grads, 3.0))


def test_auto_on_cpu_is_the_xla_path():
    rng = np.random.default_rng(3)
    grads = _grads(rng, jnp.float16, [(7,), (300,)])
    out, finite = jax.jit(unscale_and_check)(grads, jnp.float32(3.0))
    chex.assert_trees_all_equal((out, finite), _xla(grads, jnp.float32(3.0)))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="loss_scale must be a floating scalar"):
        unscale_and_check({"a": jnp.ones(3)}, jnp.ones(2), impl="interpret")
    with pytest.raises(ValueError, match="impl must be one of"):
        unscale_and_check({"a": jnp.ones(3)}, 2.0, impl="triton")


def _train(unscale_fn, params, batches, dtype):
    tx = mpjax.loss_scaled(
        optax.adam(1e-2),
        mpjax.DynamicLossScale(initial_scale=2.0**14, growth_interval=2),
        unscale_and_check=unscale_fn,
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
        def loss(p):
            pred = jnp.tanh(x @ p["w"].astype(jnp.float32)) @ p["v"].astype(jnp.float32)
            return jnp.mean((pred + p["b"].astype(jnp.float32)) ** 2)

        grads = jax.grad(lambda p: mpjax.scale_loss(loss(p), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x in batches:
        params, state = step(params, state, x)
    return params, state


def test_loss_scaled_with_the_kernel_matches_the_default_path():
    # The `unscale_and_check` hook of `loss_scaled` is the option that selects the kernel.
    dtype = jnp.bfloat16
    rng = np.random.default_rng(4)
    params = {
        "w": jnp.asarray(rng.standard_normal((6, 5)), dtype),
        "v": jnp.asarray(rng.standard_normal((5, 3)), dtype),
        "b": jnp.asarray(rng.standard_normal((3,)), dtype),
    }
    batches = [jnp.asarray(rng.standard_normal((4, 6)), jnp.float32) for _ in range(5)]
    batches[2] = batches[2].at[0, 0].set(jnp.inf)  # one skipped step
    kernel = functools.partial(unscale_and_check, impl="interpret")
    got = _train(kernel, params, batches, dtype)
    want = _train(None, params, batches, dtype)
    chex.assert_trees_all_equal(got, want)
    assert int(got[1].skipped_steps) == 1
