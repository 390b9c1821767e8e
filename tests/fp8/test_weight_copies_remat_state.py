"""`weight_copies` through `nn.remat` / `jax.checkpoint`, in a Flax-serialised state, and with
`previous=` copies of other shapes (refused at the call, naming the leaf and both shapes)."""

from __future__ import annotations

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import mpjax
from mpjax import Fp8Recipe
from mpjax._src.kernels.dispatch import jax_version
from mpjax.fp8 import WeightCopies, weight_copies
from tests.helpers.fp8 import assert_equal_trees, bits, quantize_shapes

SCALINGS = ("mxfp8", "nvfp4", "blockwise")
TOKENS = 256


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64, name="down")(nn.gelu(nn.Dense(128, name="up")(x)))


def _loss_fn(params, x):
    return jnp.mean((_Mlp().apply(params, x) - x) ** 2)


def _recipe(scaling):
    return Fp8Recipe(scaling, block_lowering="emulated")


def _data(seed=0, batches=None):
    shape = (TOKENS, 64) if batches is None else (batches, TOKENS, 64)
    return jax.random.normal(jax.random.key(seed), shape)


def _params():
    return _Mlp().init(jax.random.key(1), _data())


_quantize_shapes, _assert_equal_trees = quantize_shapes, assert_equal_trees


D, H = 64, 128


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D, name="down")(nn.gelu(nn.Dense(H, name="up")(x)))


class _RematModel(nn.Module):
    """Two remat'ed blocks (as a memory ladder's rungs wrap them)."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.remat(_Block)(name=f"block{i}")(x)
        return x


def _remat_shapes(jaxpr):
    return _quantize_shapes(jaxpr, inside="remat2")


@pytest.mark.parametrize("scaling", SCALINGS)
def test_nn_remat_layers_read_the_copies(scaling):
    model, x = _RematModel(), _data()
    params = model.init(jax.random.key(0), x)
    recipe = Fp8Recipe(scaling, block_lowering="emulated", high_precision_last=0)

    def loss_fn(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    loss = mpjax.autocast(loss_fn, fp8=recipe)
    copies = weight_copies(loss, params, x)
    assert len(copies.sites) == 4  # both kernels of both remat'ed blocks
    fast = mpjax.autocast(loss_fn, fp8=recipe, fp8_weights=copies)
    got = jax.jit(jax.value_and_grad(fast))(params, x)
    want = jax.jit(jax.value_and_grad(loss))(params, x)
    if jax_version() < (0, 11) or scaling != "blockwise":
        _assert_equal_trees(got, want)  # the step's numbers bit for bit
    else:
        # jaxlib 0.12's XLA:CPU compiles the remat'ed blockwise bodies of the two programs
        # differently (one emulated GEMM a bf16 x bf16 -> bf16 dot, the other's operands kept
        # in float32: XLA's excess precision): they differ by bf16 roundings, not the copies;
        # op by op, the step's numbers are the same bit for bit
        eager = (jax.value_and_grad(f)(params, x) for f in (fast, loss))
        _assert_equal_trees(*eager)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2e-2, atol=1e-5)
    plain = _remat_shapes(jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr)
    got = _remat_shapes(jax.make_jaxpr(jax.grad(fast))(params, x).jaxpr)
    assert plain[(D, H)] >= 2 and plain[(H, D)] >= 2  # without: each kernel in its body
    assert (D, H) not in got and (H, D) not in got  # with: no weight quantised in a body
    assert got[(x.shape[0], D)] == plain[(x.shape[0], D)]  # the activations still are


def test_jax_checkpoint_in_a_scanned_micro_batch_loop_reads_the_copies():
    recipe = _recipe("mxfp8")
    params, data = _params(), _data(seed=4, batches=3)
    body = jax.checkpoint(_loss_fn)
    loss = mpjax.autocast(body, fp8=recipe)

    def accumulate(params, data, copies=None):
        fn = loss if copies is None else mpjax.autocast(body, fp8=recipe, fp8_weights=copies)

        def micro(total, x):
            return jax.tree.map(jnp.add, total, jax.grad(fn)(params, x)), None

        return jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), data)[0]

    def once(params, data):
        return accumulate(params, data, weight_copies(loss, params, data[0]))

    _assert_equal_trees(jax.jit(once)(params, data), jax.jit(accumulate)(params, data))
    got = _quantize_shapes(jax.make_jaxpr(once)(params, data).jaxpr, inside="scan")
    plain = _quantize_shapes(jax.make_jaxpr(accumulate)(params, data).jaxpr, inside="scan")
    assert plain[(D, H)] >= 1 and (D, H) not in got and (H, D) not in got


# --- flax.serialization -----------------------------------------------------------------


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_state_holding_copies_round_trips_through_to_bytes(scaling):
    params, x = _params(), _data()
    loss = mpjax.autocast(_loss_fn, fp8=_recipe(scaling))
    copies = weight_copies(loss, params, x)
    state = {"params": params, "copies": copies, "step": jnp.int32(3)}
    data = flax.serialization.to_bytes(state)
    # restore into a target made from other weights of the same shapes (as at a restart)
    other = jax.tree.map(lambda p: p * 0.5, params)
    target = {"params": other, "copies": weight_copies(loss, other, x), "step": jnp.int32(0)}
    restored = flax.serialization.from_bytes(target, data)
    assert isinstance(restored["copies"], WeightCopies)
    assert restored["copies"].sites == copies.sites
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    # the restored copies serve the GEMMs as the originals did
    fast = mpjax.autocast(_loss_fn, fp8=_recipe(scaling), fp8_weights=restored["copies"])
    _assert_equal_trees(jax.grad(fast)(params, x), jax.grad(loss)(params, x))


def test_restoring_copies_into_a_target_of_other_shapes_is_refused():
    loss = mpjax.autocast(_loss_fn, fp8=_recipe("mxfp8"))
    copies = weight_copies(loss, _params(), _data())
    data = flax.serialization.to_bytes(copies)
    wide = {"params": {"w": jnp.ones((D, 2 * H))}}
    matmul = mpjax.autocast(lambda p, x: jnp.sum(x @ p["params"]["w"]), fp8=_recipe("mxfp8"))
    target = weight_copies(matmul, wide, _data())
    with pytest.raises(ValueError, match="copies"):
        flax.serialization.from_bytes(target, data)


# --- previous= of other shapes ----------------------------------------------------------


def test_previous_copies_of_other_shapes_are_refused_naming_the_leaf_and_shapes():
    w = {"w": jnp.ones((D, H))}
    matmul = mpjax.autocast(lambda p, x: jnp.sum(x @ p["w"]), fp8=_recipe("mxfp8"))
    copies = weight_copies(matmul, w, _data())
    bigger = {"w": jnp.ones((D, 2 * H))}
    with pytest.raises(
        ValueError,
        match=r"weight \['w'\] \(\.rows\.data\) are float8_e4m3fn\[64, 128\].*\[64, 256\]",
    ) as info:
        weight_copies(matmul, bigger, _data(), previous=copies, refresh=True)
    assert "without previous=" in str(info.value)
    with pytest.raises(ValueError, match=r"previous copies of weight \['w'\]"):  # under jit
        jax.jit(lambda w, c, r: weight_copies(matmul, w, _data(), previous=c, refresh=r))(
            bigger, copies, True
        )
    # the same shapes pass (and a refresh of False keeps them)
    kept = weight_copies(matmul, w, _data(), previous=copies, refresh=False)
    _assert_equal_trees(kept.copies, copies.copies)


def test_previous_copies_of_another_recipe_stay_refused_as_other_weights():
    # a guard, not new behaviour: another recipe's copies (other sites) are refused as before
    w = {"w": jnp.ones((D, H))}
    mx = mpjax.autocast(lambda p, x: jnp.sum(x @ p["w"]), fp8=_recipe("mxfp8"))
    nv = mpjax.autocast(lambda p, x: jnp.sum(x @ p["w"]), fp8=Fp8Recipe("nvfp4"))
    with pytest.raises(ValueError, match="other weights or another function"):
        weight_copies(nv, w, _data(), previous=weight_copies(mx, w, _data()), refresh=True)
