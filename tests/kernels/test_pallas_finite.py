"""mpjax.pallas.all_finite_unscaled: the read-only finite check, and loss_scaled's use of it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax._src.kernels import unscale
from mpjax._src.kernels.gpu_target import abstract_gpu
from mpjax.pallas import all_finite_unscaled, xla_all_finite_unscaled

TRITON = "__gpu$xla.gpu.triton"
_interpret = jax.jit(functools.partial(all_finite_unscaled, impl="interpret"))
_xla = jax.jit(xla_all_finite_unscaled)


def _grads(rng, dtypes, shapes):
    # A wide dynamic range: magnitudes from 1e-4 to 1e4 (fp16 holds them at scale 1).
    return {
        f"g{i}": jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-4, 4, s), d)
        for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
    }


SHAPES = [(1,), (5, 7), (2 * unscale.BLOCK + 5,), (130,)]
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float16]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flag_matches_float64_reference(where, bad):
    rng = np.random.default_rng(0)
    grads = _grads(rng, DTYPES, SHAPES)
    assert bool(_interpret(grads, jnp.float32(1024.0))) and bool(_xla(grads, 1024.0))
    big = grads["g2"]
    i = {"first": 0, "middle": big.size // 2, "last": big.size - 1}[where]
    grads["g2"] = big.at[i].set(bad)
    want = all(np.all(np.isfinite(np.asarray(g, np.float64) / 1024.0)) for g in grads.values())
    assert not want
    assert bool(_interpret(grads, jnp.float32(1024.0))) == want
    assert bool(_xla(grads, jnp.float32(1024.0))) == want


def test_overflow_on_unscale_is_not_finite():
    # Finite values whose unscaled value overflows float32 (scale < 1) are not finite.
    grads = {"a": jnp.full((5,), 3e38, jnp.float32), "h": jnp.ones((3,), jnp.float16)}
    assert not bool(all_finite_unscaled(grads, jnp.float32(0.5), impl="interpret"))
    assert not bool(xla_all_finite_unscaled(grads, jnp.float32(0.5)))
    assert bool(all_finite_unscaled(grads, jnp.float32(2.0), impl="interpret"))


def test_agrees_with_unscale_and_check_over_many_launches(monkeypatch):
    monkeypatch.setattr(unscale, "MAX_LEAVES_PER_CALL", 3)
    rng = np.random.default_rng(1)
    grads = [jnp.asarray(rng.standard_normal(1 + 29 * i), DTYPES[i % 3]) for i in range(8)]
    grads.append(jnp.arange(4))  # non-floating: ignored
    grads.append(jnp.zeros((0, 3), jnp.bfloat16))  # empty
    fn = jax.jit(functools.partial(all_finite_unscaled, impl="interpret"))
    assert bool(fn(grads, jnp.float32(8.0)))
    for k in (0, 4, 7):  # first, middle and last launch
        bad = list(grads)
        bad[k] = bad[k].at[-1].set(jnp.inf)
        assert not bool(fn(bad, jnp.float32(8.0)))
        assert bool(fn(bad, jnp.float32(8.0))) == bool(
            unscale.unscale_and_check(bad, jnp.float32(8.0), impl="interpret")[1]
        )


def test_kernel_reads_own_dtypes_and_writes_only_flags():
    grads = {
        "h": jnp.ones((3,), jnp.float16),
        "b": jnp.ones((33, 70), jnp.bfloat16),
        "f": jnp.ones((9000,), jnp.float32),
    }
    fn = jax.jit(functools.partial(all_finite_unscaled, impl="pallas"))
    with abstract_gpu():  # jax >= 0.11: name the GPU to lower for
        text = fn.trace(grads, jnp.float32(2.0)).lower(lowering_platforms=("cuda",)).as_text()
    [call] = [line for line in text.splitlines() if TRITON in line]
    assert 'name = "mpjax_all_finite_unscaled"' in call
    operands, results = call.split(" : ")[-1].split(" -> ")
    assert "tensor<3xf16>" in operands and "tensor<2310xbf16>" in operands
    assert "f32>" not in results.replace("tensor<1xf32>", "")  # flags only, no unscaled copy
    assert "xi32>" in results


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="all_finite_unscaled: loss_scale must be a floating"):
        all_finite_unscaled({"a": jnp.ones(3)}, jnp.ones(2), impl="interpret")
    with pytest.raises(ValueError, match="impl must be one of"):
        all_finite_unscaled({"a": jnp.ones(3)}, 2.0, impl="triton")


def _cuda_step_text(tx, params):
    state = tx.init(params)

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with abstract_gpu():  # jax >= 0.11: name the GPU to lower for
        return (
            jax.jit(step).trace(params, state, params).lower(lowering_platforms=("cuda",)).as_text()
        )


def test_loss_scaled_pallas_impl_writes_no_unscaled_copy_on_cuda():
    """impl="pallas": the only kernel is the read-only check, no float32 copy of the grads."""
    params = {"w": jnp.ones((64, 32), jnp.bfloat16), "b": jnp.ones((32,), jnp.float32)}
    text = _cuda_step_text(mpjax.loss_scaled(optax.adam(1e-3), impl="pallas"), params)
    calls = [line for line in text.splitlines() if TRITON in line]
    assert len(calls) == 1 and 'name = "mpjax_all_finite_unscaled"' in calls[0]
    results = calls[0].split(" -> ")[-1]
    assert "f32>" not in results and "bf16>" not in results


def test_loss_scaled_default_checks_with_one_reduce_per_group_on_cuda():
    """The default check on CUDA is XLA (it fuses the convert of fp16 grads): no custom call,
    and 40 leaves of two sizes take two reductions, not one per leaf."""
    params = {f"l{i}": {"k": jnp.ones((64, 64)), "b": jnp.ones((64,))} for i in range(20)}
    text = _cuda_step_text(mpjax.loss_scaled(optax.adam(1e-3)), params)
    assert TRITON not in text
    # The 20 kernels (4096 elements each) form one group, the 20 biases another.
    assert text.count("stablehlo.reduce(") + text.count("stablehlo.reduce ") <= 3, text.count(
        "reduce"
    )


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_grouped_check_row_stage_and_chunks_match_float64(monkeypatch, where, bad):
    """Large 2-D leaves (reduced per row first), more same-sized leaves than one reduce takes,
    float64 and half leaves: the flag is float64's, wherever the inf/NaN sits."""
    from mpjax._src.kernels import grouped_check

    monkeypatch.setattr(grouped_check, "MAX_OPERANDS", 4)
    rng = np.random.default_rng(2)
    shapes = [(100, 90)] * 5 + [(100,)] * 6 + [(9000,), (3, 4, 700)]
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float32, jnp.float16] + [jnp.float32] * 8
    grads = _grads(rng, dtypes, shapes)
    with jax.enable_x64(True):
        _check_grouped(grads, rng, where, bad)


def _check_grouped(grads, rng, where, bad):
    grads["f64"] = jnp.asarray(rng.standard_normal(7) * 1e300, jnp.float64)
    fn = jax.jit(xla_all_finite_unscaled)
    assert bool(fn(grads, jnp.float32(1024.0)))
    for name in ("g3", "g6", "g12"):  # a large 2-D leaf, a chunk's last small leaf, rank 3
        g = grads[name].reshape(-1)
        i = {"first": 0, "middle": g.size // 2, "last": g.size - 1}[where]
        bad_grads = {**grads, name: g.at[i].set(bad).reshape(grads[name].shape)}
        assert not bool(fn(bad_grads, jnp.float32(1024.0))), name
    # float64 leaves are unscaled in float64: 1e300 / 0.5 is finite there.
    assert bool(fn({"f64": grads["f64"]}, jnp.float32(0.5)))
    # a finite float32 value whose unscaled value overflows is not finite.
    assert not bool(fn({**grads, "g3": grads["g3"].at[5, 5].set(3e38)}, jnp.float32(0.5)))


@pytest.mark.parametrize("bad", [-np.inf, np.inf, np.nan])
def test_grouped_check_sees_a_one_element_leaf(bad):
    """A one-element leaf (XLA may fold its reduce to the element itself) still counts."""
    grads = {"c": jnp.array([bad], jnp.float16), "a": jnp.ones((3,), jnp.bfloat16)}
    assert not bool(jax.jit(xla_all_finite_unscaled)(grads, jnp.float32(2.0)))


def test_loss_scaled_auto_on_cpu_unscales_before_the_step():
    """On XLA:CPU "auto" is the eager unscale-then-check step (cheaper there than the lazy one)."""
    params = {f"w{i}": jnp.ones((64, 32), jnp.float32) for i in range(6)}
    grads = jax.tree.map(lambda p: p.astype(jnp.float16), params)

    def bytes_of(tx):
        state = tx.init(params)

        def step(grads, state, params):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        compiled = jax.jit(step).lower(grads, state, params).compile()
        return compiled.cost_analysis()["bytes accessed"]

    auto = bytes_of(mpjax.loss_scaled(optax.adam(1e-3)))
    eager = bytes_of(
        mpjax.loss_scaled(optax.adam(1e-3), unscale_and_check=mpjax.pallas.xla_unscale_and_check)
    )
    lazy = bytes_of(mpjax.loss_scaled(optax.adam(1e-3), impl="xla"))
    assert auto == eager != lazy
